"""One lock around run-state changes when the database is SQLite, and the scheduler's lock.

On Postgres, `SELECT ... FOR UPDATE` on the run row serialises two agents reporting exits of
the same run at the same moment. SQLite ignores FOR UPDATE and starts its write transaction
only at the first write, so both handlers would read "the other rank is still running" and
the run would never succeed; with SQLite the control plane is one process (`hybridtrain
local`), so a process-wide lock is exact.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager, nullcontext

from sqlalchemy import text
from sqlalchemy.orm import Session

_sqlite_lock = threading.RLock()


def run_state_lock(is_sqlite: bool) -> AbstractContextManager[object]:
    """Hold this around a transaction that reads and then changes run state."""
    return _sqlite_lock if is_sqlite else nullcontext()


# Any fixed number: it names the scheduler's Postgres advisory lock.
SCHEDULE_LOCK_KEY = 0x68747371  # "htsq"


def schedule_lock(session: Session) -> None:
    """Serialise the scheduler until the transaction ends (Postgres); SQLite's writers are one
    process under `run_state_lock`, which callers hold."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SCHEDULE_LOCK_KEY})
