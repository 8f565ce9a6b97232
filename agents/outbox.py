"""The agent's durable outbox: what must reach the control plane (role events, log batches, the
trainer's spooled reports) is written to SQLite in the state dir before anything is sent, and
one sender thread delivers it in order, retrying with backoff until the control plane takes it.

An entry leaves the outbox only when the control plane answered 2xx, or refused it for good
(a 4xx other than 408 and 429, logged), so neither a control plane that is down nor an agent
that is killed and restarted on the same state dir loses one. Heartbeats never come here: only
the latest one matters. Deliveries may repeat (an answer lost after the control plane stored
the entry); every receiving endpoint is idempotent for that reason.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agents.errors import ControlPlaneError, ControlPlaneRejected, ControlPlaneUnavailable

log = logging.getLogger(__name__)

OUTBOX_FILE = "outbox.db"
EVENT = "event"  # POST /api/v1/agent/runs/{run}/events
LOGS = "logs"  # POST /api/v1/agent/runs/{run}/logs
REPORT = "report"  # POST /api/v1/agent/runs/{run}/metrics: the trainer's spooled records
KINDS = frozenset({EVENT, LOGS, REPORT})
# Client errors that mean "not now" rather than "never".
RETRIABLE_STATUS = frozenset({408, 429})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    run_id INTEGER NOT NULL,
    body TEXT NOT NULL,
    url TEXT,  -- unused: reports once went to the trainer's URL with the run's token
    token TEXT,  -- unused, likewise
    lines INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL
)
"""


class Transport(Protocol):
    """How entries reach the control plane: its client, or a recorder in tests."""

    def role_event(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]: ...

    def logs(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]: ...

    def reports(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Entry:
    """One message waiting in the outbox."""

    id: int
    kind: str
    run_id: int
    body: dict[str, Any]


@dataclass(frozen=True)
class Message:
    """What a caller puts in."""

    kind: str
    run_id: int
    body: dict[str, Any]


class Outbox:
    """A FIFO of messages on disk and the thread that delivers them."""

    def __init__(
        self,
        state_dir: Path,
        transport: Transport,
        *,
        first_delay_s: float = 0.5,
        max_delay_s: float = 30.0,
        on_delivered: Callable[[Entry, dict[str, Any]], None] | None = None,
    ) -> None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(state_dir) / OUTBOX_FILE
        self.transport = transport
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.on_delivered = on_delivered
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        # WAL with FULL sync: a committed put survives a power cut, not just a killed agent.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        self.path.chmod(0o600)  # trainers' records and log lines
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.delivered = 0

    # -- putting --------------------------------------------------------------------------

    def put(self, kind: str, run_id: int, body: dict[str, Any]) -> None:
        """Store one message durably; the sender delivers it after every earlier one."""
        self.put_many([Message(kind, run_id, body)])

    def put_many(self, messages: Iterable[Message]) -> None:
        """Store messages in one transaction, in order: all of them or none."""
        rows = []
        for m in messages:
            if m.kind not in KINDS:
                raise ValueError(f"outbox kind {m.kind!r} is not one of {sorted(KINDS)}")
            lines = len(m.body.get("lines", [])) if m.kind == LOGS else 0
            rows.append((m.kind, int(m.run_id), json.dumps(m.body), lines, time.time()))
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(
                    "INSERT INTO outbox (kind, run_id, body, lines, created) VALUES (?, ?, ?, ?, ?)", rows,
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self._wake.set()

    # -- reading --------------------------------------------------------------------------

    def pending(self, kind: str | None = None) -> int:
        """How many messages (of `kind`) wait to be delivered."""
        with self._lock:
            if kind is None:
                row = self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()
            else:
                row = self._db.execute("SELECT COUNT(*) FROM outbox WHERE kind = ?", (kind,)).fetchone()
        return int(row[0])

    def pending_log_lines(self) -> int:
        """Log lines waiting in the outbox, which the supervisor bounds."""
        with self._lock:
            row = self._db.execute("SELECT COALESCE(SUM(lines), 0) FROM outbox").fetchone()
        return int(row[0])

    def _oldest(self) -> Entry | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, kind, run_id, body FROM outbox ORDER BY id LIMIT 1"
            ).fetchone()
            if row is None:
                return None
        return Entry(row[0], row[1], row[2], json.loads(row[3]))

    def _remove(self, entry: Entry) -> None:
        with self._lock:
            self._db.execute("DELETE FROM outbox WHERE id = ?", (entry.id,))

    # -- sending --------------------------------------------------------------------------

    def start(self) -> Outbox:
        """Start the sender thread (once the agent can authenticate its calls)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="outbox-sender", daemon=True)
            self._thread.start()
        return self

    def _deliver(self, entry: Entry) -> dict[str, Any]:
        if entry.kind == EVENT:
            return self.transport.role_event(entry.run_id, entry.body) or {}
        if entry.kind == LOGS:
            return self.transport.logs(entry.run_id, entry.body) or {}
        return self.transport.reports(entry.run_id, entry.body) or {}

    def _send_loop(self) -> None:
        delay = self.first_delay_s
        failures = 0
        while not self._closed.is_set():
            entry = self._oldest()
            if entry is None:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                answer = self._deliver(entry)
            except ControlPlaneError as exc:
                if _retriable(exc):
                    failures += 1
                    if failures == 1 or failures % 10 == 0:
                        log.warning("outbox: %s (%d waiting; retrying in %.1f s)", exc,
                                    self.pending(), delay)
                    self._closed.wait(delay)
                    delay = min(delay * 2, self.max_delay_s)
                    continue
                log.warning("outbox: the control plane refused %s of run %s for good, dropping it: %s",
                            entry.kind, entry.run_id, exc)
                answer = None
            except Exception:  # a bug here must not stop delivery of everything behind it
                log.exception("outbox: delivering %s of run %s failed; dropping it", entry.kind, entry.run_id)
                answer = None
            if failures:
                log.info("outbox: delivering again after %d failed tries", failures)
            failures, delay = 0, self.first_delay_s
            self._remove(entry)
            self.delivered += 1
            if answer is not None and self.on_delivered is not None:
                try:
                    self.on_delivered(entry, answer)
                except Exception:
                    log.exception("outbox: handling the answer to %s of run %s failed", entry.kind, entry.run_id)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every message is delivered, at most `timeout_s`; True when empty."""
        deadline = time.monotonic() + timeout_s
        while self.pending() > 0:
            if self._thread is None or time.monotonic() >= deadline:
                return False
            self._wake.set()
            time.sleep(0.02)
        return True

    def close(self) -> None:
        """Stop the sender; what is left stays on disk for the next agent on this state dir."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        with self._lock:
            self._db.close()


def _retriable(exc: ControlPlaneError) -> bool:
    if isinstance(exc, ControlPlaneUnavailable):
        return True
    return isinstance(exc, ControlPlaneRejected) and exc.status_code in RETRIABLE_STATUS
