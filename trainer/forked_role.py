"""Roles forked from the local launcher once it has imported torch, instead of fresh interpreters.

Every `python -m trainer --role ...` spends seconds of CPU importing torch (and torch._dynamo,
which a worker's first optimizer step imports) before it does anything, once per role and all
at once. The launcher imports that once, then forks each role: the child is a process of its
own (its pid takes signals, its exit status is its own, its output goes where the launcher's
does), running the trainer's command line with the role's argv and environment, and ending as
`python -m trainer` ends (trainer/role_exit.py).

What a fork cannot be is a fresh interpreter: the child's modules were imported before its
environment was set. Roles read nothing from the environment at import (their threads are set
by `torch.set_num_threads(cfg.threads)`), and the launcher forks only while that holds for the
process as a whole: one Python thread, CUDA not initialised (`fork_blocker` says why not
otherwise, and the launcher then starts fresh interpreters as before). Libraries that size a pool
from the environment at import (OpenBLAS, OpenMP) read the launcher's, which it sets to the
roles' `--threads` before it imports them.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

# What every role imports before its first step; the fork shares it.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "trainer.runtime", "trainer.server", "trainer.ps",
           "trainer.loop", "trainer.distributed_optimizer", "trainer.taskloop")

_MAIN = str(Path(__file__).resolve().parent / "__main__.py")


def preload(threads: int | None = None) -> None:
    """Import what every role imports, so that each forked role starts with it; with `threads`,
    the native pools sized at import are sized for the roles."""
    if threads is not None and "numpy" not in sys.modules and "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    for name in PRELOAD:
        importlib.import_module(name)


def fork_blocker() -> str | None:
    """Why this process may not fork roles now, or None when it may."""
    if not hasattr(os, "fork"):
        return "this platform has no fork()"
    # Python threads could hold a lock (logging's, the import system's) across the fork. Native
    # pools that libraries start at import (OpenBLAS's) are parked and handle fork themselves, as
    # they must for multiprocessing and torch's own DataLoader.
    threads = threading.active_count()
    if threads != 1:
        return f"the launcher runs {threads} threads"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the launcher has initialised CUDA"
    return None


class ForkedRole:
    """The part of `subprocess.Popen` the launcher uses, for a role forked from it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"role {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]  # poll() set it

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_role(argv: list[str], env: dict[str, str]) -> ForkedRole:
    """`python -m trainer ARGV` with environment `env`, as a child forked from this process."""
    sys.stdout.flush()
    sys.stderr.flush()
    # The launcher's own SIGTERM handler must not run in the child before the role's replaces it.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        pid = os.fork()
        if pid == 0:
            # As PYTHONSAFEPATH has it for a fresh role: the launcher's own first entry (its
            # working directory or script folder) is not searched; the role puts the user's code first.
            if not sys.flags.safe_path and sys.path:
                del sys.path[0]
            become_role(argv, env, previous)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return ForkedRole(pid)


def become_role(argv: list[str], env: dict[str, str], mask: set[signal.Signals] | None = None) -> NoReturn:
    """In a forked child: run `python -m trainer ARGV` with environment `env` (and signal mask
    `mask`), and end this process as that command ends; never returns."""
    code = 1
    try:
        from trainer.cli import main, role_in
        from trainer.role_exit import exit_role

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [_MAIN, *argv]
        role = role_in(argv) or "worker"
        try:
            code = main(argv)
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the interpreter's own report of an uncaught error
            traceback.print_exc()
        exit_role(role, code)
    except BaseException:  # noqa: BLE001 - before the role's main: say why, as a fresh process would
        traceback.print_exc()
    finally:
        os._exit(code)
