"""The control plane's periodic liveness pass (`app.lifecycle.check_liveness`): silent nodes go
offline and their ranks are lost, launches that never started fail, unanswered launch orders
are sent again, stragglers of a finished run are stopped.

One daemon thread per control-plane process. With several replicas on Postgres each runs it;
the row locks (SKIP LOCKED on nodes, FOR UPDATE on runs) make the checks safe to overlap.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from app.config import Settings
from app.db import session_scope
from app.dispatch import Dispatcher, Order
from app.lifecycle import check_liveness, run_state_lock

log = logging.getLogger(__name__)


class Monitor:
    """Runs `check_once` every `settings.monitor_interval_s` until stopped."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, dispatcher: Dispatcher) -> None:
        self.factory = factory
        self.settings = settings
        self.dispatcher = dispatcher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> list[Order]:
        """One pass: mark, fail or restart, commit, then send the orders."""
        with run_state_lock(self.settings.is_sqlite), session_scope(self.factory) as session:
            orders = check_liveness(session, settings=self.settings)
        self.dispatcher.send_quietly(orders)
        return orders

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.monitor_interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - a bad pass (database away) must not end the loop
                log.exception("liveness check failed; trying again in %.0f s", self.settings.monitor_interval_s)

    def start(self) -> None:
        """Start the background thread."""
        self._thread = threading.Thread(target=self._loop, name="liveness-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for the pass in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
