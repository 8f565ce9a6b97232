"""A role's stop on SIGTERM (a cancel or a spot notice), bounded in time.

SIGTERM first asks for a stop at the next step boundary (a worker leaves, the server writes
one last checkpoint). That boundary may be far off: the server may be waiting for workers
that are leaving too, uploading a checkpoint (up to 60 s), or evaluating. So:

1. at `soft_s` after SIGTERM, `Stopped` is raised in the main thread wherever it is: signals
   interrupt blocking socket calls, lock and queue waits, and an HTTP upload in the main
   thread, and it is a BaseException so that no `except Exception` swallows it;
2. at `hard_s`, a watchdog thread ends the process with 128 + SIGTERM without finalisation,
   for a main thread stuck in native code that a Python signal handler cannot reach.

Nothing half-written becomes a checkpoint: local files are written then renamed
(trainer.checkpoint.save), and an upload cut short fails the control plane's digest check,
so the latest complete checkpoint stays the latest.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Within about 2 s of SIGTERM a role is gone (issue 50): the agent then reports it, and the
# node is handed to the next run without waiting for the agent's SIGKILL.
SOFT_STOP_S = 1.5
HARD_STOP_S = 2.0
STOPPED_EXIT_CODE = 128 + signal.SIGTERM


class Stopped(BaseException):
    """SIGTERM came and no step boundary did within the soft deadline: stop where we are."""


@dataclass
class StopDeadline:
    """When SIGTERM came (monotonic seconds, None before) and whether `Stopped` was raised."""

    soft_s: float = SOFT_STOP_S
    hard_s: float = HARD_STOP_S
    noticed_at: float | None = None
    interrupted: bool = False
    _noticed: threading.Event = field(default_factory=threading.Event)

    def since_notice(self) -> float | None:
        """Seconds since SIGTERM, or None if it has not come."""
        return None if self.noticed_at is None else time.monotonic() - self.noticed_at


def install(on_notice: Callable[[], None], *, soft_s: float = SOFT_STOP_S,
            hard_s: float = HARD_STOP_S) -> StopDeadline:
    """Handle SIGTERM in this (main) thread: call `on_notice` (the graceful stop), then enforce
    the two deadlines above. Returns the deadline's state."""
    deadline = StopDeadline(soft_s=soft_s, hard_s=hard_s)

    def on_alarm(signum: int, frame: object) -> None:
        deadline.interrupted = True
        raise Stopped(f"SIGTERM {deadline.since_notice() or 0:.1f} s ago and no step boundary since: stopping now")

    def on_term(signum: int, frame: object) -> None:
        if deadline.noticed_at is not None:
            return  # a second SIGTERM (the group's, after the role's own) changes nothing
        deadline.noticed_at = time.monotonic()
        deadline._noticed.set()
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, soft_s)
        on_notice()

    def watchdog() -> None:
        deadline._noticed.wait()
        assert deadline.noticed_at is not None
        time.sleep(max(0.0, deadline.noticed_at + hard_s - time.monotonic()))
        print(f"[trainer] still running {hard_s:.1f} s after SIGTERM; exiting now", file=sys.stderr, flush=True)
        with_flush_exit(STOPPED_EXIT_CODE)

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()
    signal.signal(signal.SIGTERM, on_term)
    return deadline


def disarm() -> None:
    """The role has ended by itself: no alarm may interrupt its exit path."""
    signal.setitimer(signal.ITIMER_REAL, 0)


def with_flush_exit(code: int) -> None:
    """Flush stdout and stderr, then leave at once (no finalisation, no thread joins)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
