"""`python -m trainer ...`: the same command line as `hybridtrain train ...`."""

import atexit
import os
import sys
import threading

from trainer.cli import main, role_in

code = main(sys.argv[1:])
role = role_in(sys.argv[1:])
if role is None:
    sys.exit(code)
# A role ends without the interpreter's finalisation: with torch's threads still parked in
# native code (gloo, the PS client's receivers), finalisation aborted a finished role now and
# then ("terminate called without an active exception", exit -6), turning a finished run into a
# failed one. A worker runs the user's script, so what a script may expect of a normal exit
# happens first: its own non-daemon threads are joined and its atexit handlers run.
if role == "worker":
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - CPython's own exit path, which os._exit skips
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
