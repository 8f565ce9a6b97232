"""The control plane's periodic liveness pass (`app.lifecycle.check_liveness`): silent nodes go
offline and their ranks are lost, launches that never started fail, unanswered launch orders
are sent again, stragglers of a finished run are stopped. After each pass, the final bills that
are missing (cleared by a late report, or of runs that ended before bills were stored) are
stored, a few at a time (`app.queries.final_bills.settle_final_bills`).

One daemon thread per control-plane process. With several processes on Postgres (`hybridtrain
server --workers N`, or replicas behind a proxy) each runs it, but a pass first takes a
transaction-level advisory lock without waiting: a process that finds another's pass in
progress skips its turn, so passes never overlap and each one sees what the last committed.
The row locks inside (SKIP LOCKED on nodes, FOR UPDATE on runs, the scheduler's own advisory
lock) still guard against the request handlers that change the same rows. On SQLite the
control plane is one process (`run_state_lock` is a process-wide lock).
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from app.config import Settings
from app.db import session_scope
from app.dispatch import Dispatcher, Order
from app.lifecycle import check_liveness, run_state_lock
from app.models.base import utcnow
from app.queries.final_bills import settle_final_bills

log = logging.getLogger(__name__)

# Final bills stored per pass: a few hundred milliseconds of grouped reads at most, so that a
# backlog (a deployment's first start with this version) never makes one pass long.
BILLS_PER_PASS = 100

# Any fixed number: it names the liveness pass's Postgres advisory lock ("htlv").
LIVENESS_LOCK_KEY = 0x68746C76


def take_liveness_turn(session: Session) -> bool:
    """Whether this transaction may run the liveness pass: False while another process's pass
    holds the lock (Postgres); always True on SQLite, whose control plane is one process."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(session.scalar(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": LIVENESS_LOCK_KEY}))


class Monitor:
    """Runs `check_once` every `settings.monitor_interval_s` until stopped."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, dispatcher: Dispatcher) -> None:
        self.factory = factory
        self.settings = settings
        self.dispatcher = dispatcher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> list[Order]:
        """One pass: mark, fail or restart, commit, then send the orders; none when another
        process's pass is in progress."""
        with run_state_lock(self.settings.is_sqlite), session_scope(self.factory) as session:
            if not take_liveness_turn(session):
                log.debug("another process's liveness pass is in progress; skipping this one")
                return []
            orders = check_liveness(session, settings=self.settings)
        self.dispatcher.send_quietly(orders)
        return orders

    def settle_bills_once(self) -> int:
        """Store up to `BILLS_PER_PASS` missing final bills, in a transaction of their own (the
        liveness pass's locks are not held meanwhile); returns how many."""
        with session_scope(self.factory) as session:
            return settle_final_bills(session, now=utcnow(), limit=BILLS_PER_PASS)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.monitor_interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - a bad pass (database away) must not end the loop
                log.exception("liveness check failed; trying again in %.0f s", self.settings.monitor_interval_s)
            try:
                self.settle_bills_once()
            except Exception:  # noqa: BLE001 - the overview bills the run live meanwhile
                log.exception("storing final bills failed; trying again in %.0f s", self.settings.monitor_interval_s)

    def start(self) -> None:
        """Start the background thread."""
        self._thread = threading.Thread(target=self._loop, name="liveness-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for the pass in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
