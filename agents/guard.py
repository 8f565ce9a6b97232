"""The role guard: a tiny process between the agent and one trainer role, so that no role
outlives its agent, even an agent killed with SIGKILL.

Run as `python -m agents.guard AGENT_PID -- COMMAND [ARGS...]`. The agent starts the guard in
a new session, so the guard's pid is the role's process-group id. The guard:

1. asks the kernel (prctl PR_SET_PDEATHSIG) for SIGUSR1 when the agent's spawning thread
   dies, then checks that the agent is still its parent, closing the race where the agent
   died before the prctl took effect;
2. forks and execs the role inside its own process group;
3. on SIGUSR1 (agent gone) SIGKILLs the whole group, itself included, which also reaches
   the role's own children that a signal to the role alone would orphan;
4. ignores SIGTERM and SIGINT for itself: the agent's cancel sends SIGTERM to the group, the
   role shuts down gracefully and the guard only reports how it ended;
5. exits with the role's status: the same exit code, or death by the same signal (SIGKILL
   included, so an OOM-killed role reads as "killed by SIGKILL" to the supervisor).

The guard imports nothing heavy, so it adds a few milliseconds and a few MB per role.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import NoReturn

PR_SET_PDEATHSIG = 1


def _kill_group(signum: int, frame: object) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _ignore(signum: int, frame: object) -> None:
    # A Python handler, unlike SIG_IGN, is reset to the default by exec, so the role still
    # receives SIGTERM/SIGINT normally.
    return None


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        print(f"guard: prctl(PR_SET_PDEATHSIG) failed: errno {errno}", file=sys.stderr)
        return False
    return True


def main(argv: list[str]) -> int:
    """Run the guard; returns only on a usage error (otherwise it exits as the role did)."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m agents.guard AGENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    agent_pid = int(argv[0])
    command = argv[2:]

    signal.signal(signal.SIGUSR1, _kill_group)
    signal.signal(signal.SIGTERM, _ignore)
    signal.signal(signal.SIGINT, _ignore)
    _set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != agent_pid:
        # The agent died between fork and prctl: the death signal will never come.
        return 125

    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            os.execvp(command[0], command)
        except OSError as exc:
            print(f"guard: cannot execute {command[0]!r}: {exc}", file=sys.stderr, flush=True)
            os._exit(127)

    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 1
    if os.WIFSIGNALED(status):
        _die_like(os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status)


def _die_like(signum: int) -> NoReturn:
    """End the guard by `signum`, as its role ended (128 + signum if that does not kill it)."""
    sys.stdout.flush()
    # SIGKILL cannot be caught, so its disposition is already the default and setting it
    # fails with EINVAL (issue 15: the guard of an OOM-killed role crashed right there).
    if signum != signal.SIGKILL:
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    os.kill(os.getpid(), signum)
    # Only a signal whose default is to be ignored (SIGCHLD, SIGURG, ...) gets here.
    sys.exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
