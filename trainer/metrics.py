"""Metrics as JSON lines (docs/architecture.md): to a file and, in batches, to the control plane.

Every record carries its process's `stream` (a random id) and its number in it, `seq`, so the
control plane stores each record exactly once however often it is delivered. The HTTP
reporter runs in a daemon thread behind a bounded queue: training only ever does a
non-blocking put. A batch that fails for a transient reason (no connection, a timeout, 5xx,
408, 429) is retried with backoff for as long as the process lives; a record the queue cannot
hold, and whatever is still undelivered when `close()`'s deadline passes, goes to the report
spool (JSON lines, each record exactly as it would have been POSTed), which the node's agent
delivers after the process exits. So does a batch refused with 403: the run has ended and its
token reports no more, but the agent delivers with its own. Only a record refused outright
(another 4xx) or one with no spool to go to is dropped, and every drop is counted and warned
about.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
import uuid
from typing import IO, Any

from hybridtrain.contract import EVENT_KINDS, SYSTEM_METRICS, check_metric_name

log = logging.getLogger("trainer.metrics")


def new_stream_id() -> str:
    """A random id for one process's records (64 bits: no two processes of a run share one)."""
    return uuid.uuid4().hex[:16]


class HttpReporter:
    """POSTs `{"records": [...]}` batches with a bearer token from a background thread."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        spool: str | None = None,
        max_queue: int = 50_000,
        batch_size: int = 500,
        interval_s: float = 1.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        timeout_s: float = 5.0,
        client: Any = None,
    ) -> None:
        import httpx

        self.url = url
        self.spool = spool
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.sent = 0
        self.spooled = 0
        self.dropped = 0
        self._queue: queue.Queue[dict] = queue.Queue(maxsize=max_queue)
        self._inflight: list[dict] = []
        self._spool_lock = threading.Lock()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = client or httpx.Client(timeout=timeout_s, headers=headers)
        self._stop = threading.Event()
        self._give_up_at = float("inf")
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="metrics-reporter", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        """Queue a record without ever blocking; when the queue is full it goes to the spool."""
        if self._closed:
            self._to_spool([record], "reported after close")
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._to_spool([record], "queue full")

    def _to_spool(self, records: list[dict], why: str) -> None:
        if not records:
            return
        if self.spool is None:
            self._drop(len(records), f"{why}, and no report spool")
            return
        try:
            with self._spool_lock, open(self.spool, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()
        except OSError as exc:
            self._drop(len(records), f"{why}, and the spool {self.spool} failed: {exc}")
            return
        self.spooled += len(records)
        log.warning("metrics reporter spooled %d record(s) to %s (%s)", len(records), self.spool, why)

    def _drop(self, n: int, why: str) -> None:
        self.dropped += n
        log.warning("metrics reporter dropped %d record(s) (%s); %d dropped so far", n, why, self.dropped)

    def _take_batch(self, wait_s: float) -> list[dict]:
        batch: list[dict] = []
        deadline = time.monotonic() + wait_s
        while len(batch) < self.batch_size:
            timeout = deadline - time.monotonic()
            try:
                batch.append(self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _attempt(self, batch: list[dict]) -> str | None:
        """One POST: None when the batch is settled (stored, or refused for good), else why not."""
        try:
            resp = self._client.post(self.url, json={"records": batch})
        except Exception as exc:  # noqa: BLE001 - any transport failure is retried the same way
            return type(exc).__name__
        if 200 <= resp.status_code < 300:
            self.sent += len(batch)
            return None
        if resp.status_code == 403:
            # The run has ended: the agent delivers the spool under its own token.
            self._to_spool(batch, f"HTTP 403: {resp.text[:200]}")
            return None
        # A 4xx other than 408/429 will not get better by retrying (nor by spooling).
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
            self._drop(len(batch), f"HTTP {resp.status_code}: {resp.text[:200]}")
            return None
        return f"HTTP {resp.status_code}"

    def _deliver(self) -> bool:
        """Post the batch in flight until it is settled (True) or the give-up time passes."""
        delay = self.backoff_s
        while True:
            why = self._attempt(self._inflight)
            if why is None:
                self._inflight = []
                return True
            wait = min(delay, self._give_up_at - time.monotonic())
            if wait <= 0:
                return False
            log.info("metrics reporter: %s; retrying in %.1f s", why, wait)
            if self._stop.is_set():
                time.sleep(wait)
            else:
                self._stop.wait(wait)  # a close() cuts the wait short: try again at once
            delay = min(delay * 2, self.max_backoff_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._inflight:
                self._inflight = self._take_batch(self.interval_s)
            if self._inflight:
                self._deliver()
        # Closing: deliver what is left until the deadline, then spool the rest.
        while time.monotonic() < self._give_up_at:
            if not self._inflight:
                self._inflight = self._take_batch(0.0)
                if not self._inflight:
                    return
            if not self._deliver():
                break
        left = self._inflight + self._take_all()
        self._inflight = []
        self._to_spool(left, "not delivered by the close deadline")

    def _take_all(self) -> list[dict]:
        records: list[dict] = []
        while True:
            try:
                records.append(self._queue.get_nowait())
            except queue.Empty:
                return records

    def close(self, deadline_s: float = 10.0) -> None:
        """Deliver what is queued for at most `deadline_s`, spool the rest, stop the thread."""
        self._give_up_at = time.monotonic() + deadline_s
        self._stop.set()
        # A POST under way when the deadline passes ends by its own timeout.
        self._thread.join(timeout=deadline_s + self.timeout_s + 5.0)
        if self._thread.is_alive():
            log.warning("metrics reporter did not stop within %.0f s", deadline_s + self.timeout_s + 5.0)
        self._closed = True
        self._to_spool(self._take_all(), "reported while closing")
        self._client.close()


class MetricsLogger:
    """One rank's metrics: builds the records and hands them to the file and the reporter."""

    def __init__(
        self,
        rank: int,
        role: str,
        path: str | None = None,
        reporter: HttpReporter | None = None,
    ) -> None:
        self.rank = rank
        self.role = role
        self.reporter = reporter
        # Line-buffered: a record is in the file (the kernel's page cache) before the reporter
        # may send it, so a SIGKILL never leaves the control plane with a record the file lacks
        # (the fault benchmark counts lost and doubled points against the file). A write per
        # record costs microseconds against steps of tens of milliseconds.
        self._file: IO[str] | None = open(path, "a", buffering=1) if path else None
        self.last: dict[str, float] = {}
        self._checked: set[str] = set()
        self.stream = new_stream_id()
        # next() on a count is atomic under the GIL: threads of one rank may log concurrently.
        self._seq = itertools.count()

    def log(self, step: int, name: str, value: float, peer: int | None = None) -> None:
        """Record one measurement."""
        if name not in SYSTEM_METRICS and name not in self._checked:
            check_metric_name(name)  # a task's own metric: any name of the contract's form
            self._checked.add(name)
        record: dict[str, Any] = {
            "rank": self.rank, "role": self.role, "step": step, "t": round(time.time(), 6),
            "name": name, "value": float(value),
        }
        if peer is not None:
            record["peer"] = peer
        self.last[name] = float(value)
        self._emit(record)

    def event(self, step: int, kind: str, *, subject: int | None = None, detail: str = "") -> None:
        """Record one run event (hybridtrain.contract.EVENT_KINDS) about rank `subject`."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown run event {kind!r}; one of {sorted(EVENT_KINDS)}")
        record: dict[str, Any] = {
            "rank": self.rank, "role": self.role, "step": step, "t": round(time.time(), 6),
            "event": kind, "subject": subject, "detail": detail,
        }
        self._emit(record)

    def _emit(self, record: dict[str, Any]) -> None:
        record["stream"] = self.stream
        record["seq"] = next(self._seq)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self.reporter is not None:
            self.reporter.put(record)

    def log_bytes(self, step: int, sent: dict[int, int], recv: dict[int, int]) -> None:
        """Per-link byte counts of one step."""
        for peer, n in sorted(sent.items()):
            self.log(step, "bytes_sent", n, peer=peer)
        for peer, n in sorted(recv.items()):
            self.log(step, "bytes_recv", n, peer=peer)

    def close(self) -> None:
        """Flush the file and the reporter."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.reporter is not None:
            self.reporter.close()
