"""Trainer roles forked from one interpreter that has imported torch already.

Every `python -m trainer --role ...` a test starts spends seconds of CPU importing torch before
it does anything, four or five of them at once on the suite's two cores: most of an elastic
test's time. The zygote is one process, started once per test session, that imports torch and
the trainer and then forks a child for each role that a test starts by itself (the local
launcher forks its own roles the same way: trainer/forked_role.py, whose `become_role` the
child runs). The child is a process of its own (its pid takes signals, its exit status is its
own, its stdout and stderr go to the pipe the test reads), with the role's argv, working
directory and environment, ending as `python -m trainer` ends.

What a fork cannot be is a fresh interpreter: the child's modules were imported before its
argv, cwd and environment were set. Tests of interpreter start or exit themselves (a role's
exit code under finalisation, environment read at import) start `python -m trainer --role`
as a real process instead. Run as a script, this file is the zygote.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

# What a role imports before its argv matters: the fork shares it. torch._dynamo too (and the
# sympy it imports): a worker's first optimizer imports it (torch.optim's add_param_group is
# wrapped in torch._disable_dynamo), about 2 s of CPU in every forked worker otherwise.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "numpy", "sklearn.datasets", "trainer.cli",
           "trainer.server", "trainer.ps", "trainer.loop", "trainer.distributed_optimizer", "trainer.taskloop",
           "hybridtrain.tasks.digits")


class ForkedProcess:
    """The part of `subprocess.Popen` the trainer tests use, for a child of the zygote."""

    def __init__(self, conn: socket.socket, stdout: IO[str]) -> None:
        self._conn = conn
        self._buffer = b""
        self.stdout = stdout
        self.returncode: int | None = None
        line = self._line(timeout=60.0)
        if line is None:
            raise RuntimeError("the zygote did not fork the role within 60 s")
        self.pid: int = json.loads(line)["pid"]

    def _line(self, timeout: float | None) -> bytes | None:
        """The zygote's next line; None if none came within `timeout`, b"" if it hung up."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            more = self._conn.recv(4096)
            if not more:
                return b""
            self._buffer += more
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        line = self._line(timeout)
        if line is None:
            return None
        if not line:  # the zygote went away, and killed its children as it went
            self.returncode = -signal.SIGKILL
        else:
            self.returncode = os.waitstatus_to_exitcode(json.loads(line)["status"])
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked role {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The test session's side: starts the zygote and asks it for children."""

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        self.path = directory / "zygote.sock"
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.path)], env=env, cwd=env.get("PYTHONPATH"),
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not self.path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def spawn(self, argv: list[str], *, cwd: Path, env: dict[str, str]) -> ForkedProcess:
        """`python -m trainer ARGS` as a forked child: argv is the command after `-m trainer`."""
        read, write = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.path))
            request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode()
            socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [write])
        finally:
            os.close(write)
        return ForkedProcess(conn, os.fdopen(read, "r"))

    def close(self) -> None:
        """Stop the zygote (its children with it) and remove its socket."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()


# -- the zygote itself --------------------------------------------------------------------------
def _recv_request(conn: socket.socket) -> tuple[dict, int]:
    head, fds, _, _ = socket.recv_fds(conn, 8, 1)
    size = int.from_bytes(head, "big")
    body = conn.recv(size, socket.MSG_WAITALL)
    if len(body) != size:
        raise ConnectionError("the request was cut short")
    return json.loads(body), fds[0]


def _child(request: dict, fd: int) -> None:
    """In the forked child: become `python -m trainer ARGV` and never return."""
    from trainer.forked_role import become_role

    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
    except BaseException:  # noqa: BLE001 - a child that cannot become the role says so and ends
        import traceback

        traceback.print_exc()
        os._exit(1)
    become_role(request["argv"], request["env"])


def serve(path: str) -> None:
    """Import, listen on `path`, fork a child per request, report each child's exit status."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    try:
        _loop(listener, selector, children, parent)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _loop(listener: socket.socket, selector: selectors.BaseSelector, children: dict[int, socket.socket],
          parent: int) -> None:
    while os.getppid() == parent:
        for _ in selector.select(timeout=0.02):
            conn, _ = listener.accept()
            request, fd = _recv_request(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in children.values():
                    other.close()
                _child(request, fd)
            os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
