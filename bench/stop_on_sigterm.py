"""How long a PS run's roles outlive SIGTERM, as a cancel sends it (issue 50).

Starts the roles of a small ps-bz-gc run on 127.0.0.1 as the agent does (each in its own
session), lets them reach a point, SIGTERMs every group at once, and times each exit:

- `waiting`: the server alone, waiting for workers that have not connected yet (a cancel
  soon after launch, while the workers still import torch);
- `training`: every role mid-training;
- `busy`: mid-training with evaluation every 10 steps, checkpoints every 5 and two loader
  processes per worker.

    .venv/bin/python bench/stop_on_sigterm.py [--repeats 3]

Prints one line per scenario: the slowest role's seconds from SIGTERM to exit (median and
max over the repeats) and the exit codes; a role still alive after --give-up-s is SIGKILLed
and counted as that many seconds (it would have waited for the agent's SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = "hybridtrain.tasks.digits:smallcnn"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _start(scenario: str, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], int]:
    port = _free_port()
    extra = ["--eval-every", "10", "--checkpoint-every", "5", "--checkpoint-dir", str(tmp / "ckpt"),
             "--data-workers", "2"] if scenario == "busy" else []
    roles = [("ps", 0)] if scenario == "waiting" else [("ps", 0), ("worker", 1), ("worker", 2)]
    procs = []
    for role, rank in roles:
        argv = [sys.executable, "-m", "trainer", "--strategy", "ps-bz-gc", "--task", TASK, "--global-batch", "64",
                "--max-steps", "100000", "--device", "cpu", "--threads", "1", *extra, "--role", role,
                "--rank", str(rank), "--world-size", "3", "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--metrics-out", str(tmp / f"metrics{rank}.jsonl")]
        log = open(tmp / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}))
    return procs, port


def _steps(tmp: Path) -> int:
    try:
        text = (tmp / "rank0.log").read_text(errors="replace")
    except OSError:
        return 0
    return text.count("[ps] step ")


def _ready(scenario: str, procs: list[subprocess.Popen[bytes]], port: int, tmp: Path) -> bool:
    if scenario == "waiting":
        return _listening(port)
    # Two progress lines of the server: training for a few seconds.
    return _steps(tmp) >= 2


def one(scenario: str, give_up_s: float) -> tuple[float, list[int]]:
    """Seconds from SIGTERM until the last role exited, and the exit codes."""
    with tempfile.TemporaryDirectory(prefix="stop-bench-") as name:
        tmp = Path(name)
        procs, port = _start(scenario, tmp)
        try:
            deadline = time.monotonic() + 300
            while not _ready(scenario, procs, port, tmp):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{scenario}: the roles did not get going:\n"
                                       + (tmp / "rank0.log").read_text(errors="replace")[-2000:])
                time.sleep(0.1)
            time.sleep(1.0 if scenario == "waiting" else 0.5)
            start = time.monotonic()
            for p in procs:
                os.killpg(p.pid, signal.SIGTERM)
            codes, last = [], 0.0
            for p in procs:
                try:
                    codes.append(p.wait(timeout=max(0.1, start + give_up_s - time.monotonic())))
                    last = max(last, time.monotonic() - start)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    codes.append(p.wait())
                    last = give_up_s
            return last, codes
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--give-up-s", type=float, default=15.0)
    parser.add_argument("--scenarios", default="waiting,training,busy")
    args = parser.parse_args()
    print(f"{'scenario':<10} {'median s':>9} {'max s':>7}  exit codes")
    for scenario in args.scenarios.split(","):
        runs = [one(scenario, args.give_up_s) for _ in range(args.repeats)]
        times = [t for t, _ in runs]
        codes = sorted({c for _, cs in runs for c in cs})
        print(f"{scenario:<10} {statistics.median(times):>9.2f} {max(times):>7.2f}  {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
