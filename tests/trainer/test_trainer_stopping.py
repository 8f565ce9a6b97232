"""A role stops within about 2 s of SIGTERM wherever it is (trainer.stopping): the graceful stop
at a step boundary when one comes, else `Stopped` in the main thread, else a hard exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.stopping import HARD_STOP_S, SOFT_STOP_S, STOPPED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]


def _start(code: str) -> subprocess.Popen[str]:
    """A Python process running `code`, which prints READY once SIGTERM is handled."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _terminate(proc: subprocess.Popen[str], *, ready: str = "READY") -> tuple[int, float, str]:
    """Wait for `ready`, SIGTERM the process; its exit code, seconds to exit and output."""
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.strip() == ready, first + proc.stdout.read()
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("still running 15 s after SIGTERM")
    return code, time.monotonic() - start, proc.stdout.read()


def test_a_role_blocked_in_a_socket_read_stops_at_the_soft_deadline():
    proc = _start("""
        import socket, sys
        from trainer import stopping
        left, right = socket.socketpair()
        stopping.install(lambda: print("notice", flush=True))
        print("READY", flush=True)
        try:
            left.recv(1)  # no step boundary ever comes
        except stopping.Stopped as exc:
            print("stopped:", exc, flush=True)
            sys.exit(7)
    """)
    code, took, out = _terminate(proc)
    assert code == 7 and "notice" in out and "stopped: SIGTERM" in out
    assert SOFT_STOP_S - 0.2 <= took < HARD_STOP_S


def test_a_role_whose_main_thread_cannot_take_the_signal_is_ended_at_the_hard_deadline():
    proc = _start("""
        import signal, threading
        from trainer import stopping
        stopping.install(lambda: signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM]))
        print("READY", flush=True)
        threading.Event().wait()  # as stuck as native code: the alarm is never delivered
    """)
    code, took, out = _terminate(proc)
    assert code == STOPPED_EXIT_CODE and "exiting now" in out
    assert HARD_STOP_S - 0.2 <= took < HARD_STOP_S + 1.5


def test_a_role_that_stops_at_a_boundary_in_time_ends_as_it_chose():
    proc = _start("""
        import sys, time
        from trainer import stopping
        leave = []
        stopping.install(lambda: leave.append(True))
        print("READY", flush=True)
        while not leave:
            time.sleep(0.01)  # a short step
        stopping.disarm()
        sys.exit(0)
    """)
    code, took, _ = _terminate(proc)
    assert code == 0 and took < SOFT_STOP_S


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_server_waiting_for_its_workers_ends_within_about_two_seconds_of_sigterm(tmp_path):
    # Before trainer.stopping, SIGTERM only set a flag read at the next step boundary, and a
    # server waiting for workers (start wait: 120 s) has none: it lived until SIGKILL.
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "--strategy", "ps", "--task", "hybridtrain.tasks.digits:smallcnn",
         "--global-batch", "8", "--max-steps", "5", "--device", "cpu", "--threads", "1",
         "--role", "ps", "--rank", "0", "--world-size", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(port), "--metrics-out", str(tmp_path / "m.jsonl")],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server never listened"
            time.sleep(0.1)
        time.sleep(0.5)  # past the listen, into the wait for workers
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=15)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = proc.communicate()[0]
    assert code == STOPPED_EXIT_CODE and took < HARD_STOP_S + 0.5, (code, took, out[-2000:])
    assert "stopped: SIGTERM" in out


def test_loader_processes_leave_sigterm_to_their_role():
    # The agent's SIGTERM reaches the role's whole group; a loader process that died of it
    # failed the role ("DataLoader worker killed by signal") instead of letting it leave.
    import psutil
    import torch
    from torch.utils.data import TensorDataset

    from trainer.loader import make_loader

    data = TensorDataset(torch.arange(64, dtype=torch.float32).unsqueeze(1))
    # Only the loader's own processes: the session may hold others (an object store's server).
    before = set(psutil.Process().children())
    batches = make_loader(data, first_step=1, last_step=16, worker=0, batch_sizes=[4], seed=0, workers=2)
    try:
        # At once, before a batch: the processes may not have reached their worker_init_fn yet.
        loaders = [c for c in psutil.Process().children() if c not in before]
        assert len(loaders) == 2, loaders
        for child in loaders:
            child.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Every batch still comes (torch's loader raises if one of its processes died).
        got = list(batches)
    finally:
        del batches  # the loader stops its processes now, also when an assertion failed
    assert len(got) == 16
