"""How a role's process ends, whether it was started as `python -m trainer` or forked."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_role(role: str, code: int) -> NoReturn:
    """End this role's process with `code`, without the interpreter's finalisation.

    With torch's threads still parked in native code (gloo, the PS client's receivers),
    finalisation aborted a finished role now and then ("terminate called without an active
    exception", exit -6), turning a finished run into a failed one. A worker runs the user's
    script, so what a script may expect of a normal exit happens first: its own non-daemon
    threads are joined and its atexit handlers run.
    """
    if role == "worker":
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()  # noqa: SLF001 - CPython's own exit path, which os._exit skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
