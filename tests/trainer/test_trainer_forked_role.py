"""The local launcher forks its roles once it has imported torch (trainer/forked_role.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from trainer.forked_role import fork_blocker, fork_role
from trainer.launch import free_port
from trainer.stopping import STOPPED_EXIT_CODE
from trainer_testing import ROOT, run_cli

ROLE_SCRIPT = """
import json, os, sys
import torch
import hybridtrain as ht

ctx = ht.init()
open(f"role{ctx.rank}.json", "w").write(json.dumps({
    "rank": ctx.rank, "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
    "safe_path": os.environ.get("PYTHONSAFEPATH"),
    "cmdline": open("/proc/self/cmdline").read().split("\\0"),
}))
"""


def test_the_launchers_roles_are_forked_with_each_roles_own_environment(tmp_path):
    (tmp_path / "train.py").write_text(ROLE_SCRIPT)
    # run_cli's launcher runs with OMP_NUM_THREADS=1; the roles are to get --threads 2.
    proc = run_cli("--strategy", "allreduce", "--workers", "2", "--threads", "2", "--script", "train.py",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fresh interpreter" not in proc.stderr
    roles = [json.loads((tmp_path / f"role{rank}.json").read_text()) for rank in (0, 1)]
    for role in roles:
        assert role["omp"] == "2" and role["threads"] == 2 and role["safe_path"] == "1"
        assert "--role" not in role["cmdline"]  # the launcher's own command line: a fork, not an exec


def test_a_forked_role_ends_with_its_own_exit_status_and_output(capfd):
    role = fork_role(["--strategy", "no-such-strategy", "--role", "worker"], dict(os.environ))
    assert role.wait(timeout=60) == 2
    assert "no-such-strategy" in capfd.readouterr().err


def test_a_forked_role_takes_its_signals_as_its_own_process(tmp_path):
    # A server waiting for workers that never come leaves at SIGTERM with the stopped status:
    # its own handler, not the launcher's.
    port = free_port()
    role = fork_role(["--task", "hybridtrain.tasks.digits:smallcnn", "--strategy", "ps-bz-gc", "--role", "ps",
                      "--rank", "0", "--world-size", "3", "--master-addr", "127.0.0.1", "--master-port", str(port),
                      "--threads", "1", "--metrics-out", str(tmp_path / "m.jsonl")], dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while not _listening(port):
            assert role.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(0.5)  # past the listen, into the wait for workers
        role.send_signal(signal.SIGTERM)
        assert role.wait(timeout=30) == STOPPED_EXIT_CODE
    finally:
        role.kill()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_launcher_running_a_second_thread_is_not_forked_from():
    # In a process of its own: the test session's process runs threads of its own.
    check = """
import threading
from trainer.forked_role import fork_blocker, preload
preload()
assert fork_blocker() is None, fork_blocker()
stop = threading.Event()
threading.Thread(target=stop.wait).start()
print(fork_blocker())
stop.set()
"""
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "the launcher runs 2 threads"
