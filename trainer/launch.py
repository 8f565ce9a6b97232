"""Local launcher: every role of a run as a subprocess on 127.0.0.1, supervised like torchrun.

Under a parameter server the run is the server's: a worker that dies is reported and the
others train on (the server drops it, docs/elastic.md); the launcher exits with the server's
outcome. Under all-reduce, if a role exits non-zero the others are stopped at once (they
would otherwise wait for it until their timeout), and the launcher exits 1 naming the role. Per-rank metric files are merged into
--metrics-out, ordered by time, when the run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridtrain.contract import SYSTEM_METRICS
from trainer.config import TrainConfig
from trainer.forked_role import ForkedRole, fork_blocker, fork_role, preload

_TRAINER_ROOT = str(Path(__file__).resolve().parent.parent)


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _role_of(cfg: TrainConfig, rank: int) -> str:
    return "ps" if cfg.is_ps and rank == 0 else "worker"


def _merge_metrics(out: str, parts: list[str]) -> list[dict]:
    records = []
    for part in parts:
        if os.path.exists(part):
            with open(part) as fh:
                records.extend(json.loads(line) for line in fh if line.strip())
            os.unlink(part)
    records.sort(key=lambda r: (r["t"], r["rank"]))
    with open(out, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    return records


def _summary(cfg: TrainConfig, records: list[dict], wall_s: float) -> str:
    records = [r for r in records if "name" in r]  # run events have no value to sum
    evals = {r["name"]: r["value"] for r in records
             if r["name"] not in SYSTEM_METRICS and r["rank"] == 0 and r["value"] is not None}
    tta = [r["value"] for r in records if r["name"] == "time_to_target_s"]
    sent = sum(r["value"] for r in records if r["name"] == "bytes_sent")
    steps = max((r["step"] for r in records if r["name"] in ("loss", "batch_size")), default=0)
    parts = [f"{cfg.strategy}: {steps} steps in {wall_s:.1f}s"]
    parts += [f"final {name} {value:.4f}" for name, value in sorted(evals.items())]
    if tta:
        parts.append(f"time to {cfg.target} {tta[0]:.1f}s")
    elif cfg.target is not None:
        parts.append(f"target {cfg.target} not reached")
    parts.append(f"{sent / 1e6:.2f} MB sent in total")
    return "; ".join(parts)


def _stop(procs: list[subprocess.Popen | ForkedRole], grace_s: float = 5.0) -> None:
    deadline = time.monotonic() + grace_s
    if grace_s > 5.0:  # a finished run: the roles are on their way out by themselves
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _supervise(cfg: TrainConfig, procs: list[subprocess.Popen | ForkedRole]) -> int:
    """Wait for the roles; 0 once the run has ended well. Under a parameter server the run
    is the server's: a worker that dies is reported and the others train on without it."""
    told: set[int] = set()
    while True:
        codes = [p.poll() for p in procs]
        if cfg.is_ps:
            for rank, code in enumerate(codes[1:], 1):
                if code not in (None, 0) and rank not in told:
                    told.add(rank)
                    print(f"hybridtrain train: worker rank {rank} exited with status {code}; the others train "
                          "on without it", file=sys.stderr, flush=True)
            if codes[0] is None and all(c not in (None, 0) for c in codes[1:]):
                # No worker is left to join the server locally: nothing more will happen.
                print("hybridtrain train: error: every worker has failed; stopping the server",
                      file=sys.stderr, flush=True)
                _stop(procs)
                return 1
            if codes[0] is not None:
                if codes[0] != 0:
                    print(f"hybridtrain train: error: the server (rank 0) exited with status {codes[0]}; "
                          "stopping the workers", file=sys.stderr, flush=True)
                    _stop(procs)
                    return 1
                # The server has said BYE to every worker: give them a moment to exit.
                _stop(procs, grace_s=30.0)
                for rank, p in enumerate(procs[1:], 1):
                    if p.returncode not in (0, None) and rank not in told:
                        print(f"hybridtrain train: worker rank {rank} exited with status {p.returncode} after "
                              "the run ended", file=sys.stderr, flush=True)
                return 0
        else:
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"hybridtrain train: error: {_role_of(cfg, rank)} rank {rank} exited with status "
                      f"{code}; stopping the other roles", file=sys.stderr, flush=True)
                _stop(procs)
                return 1
            if all(c == 0 for c in codes):
                return 0
        time.sleep(0.1)


def _may_fork(threads: int) -> bool:
    """Whether the roles are forked from this process (trainer/forked_role.py): torch imported
    once, not once per role. Otherwise, and said so, each role is a fresh interpreter."""
    blocker = fork_blocker()
    if blocker is None:
        preload(threads)
        blocker = fork_blocker()  # what was imported must not have started a thread
    if blocker is not None:
        print(f"hybridtrain train: starting each role in a fresh interpreter: {blocker}", file=sys.stderr, flush=True)
    return blocker is None


def _interrupt(signum: int, frame: object) -> None:
    # Once: a second SIGTERM (a process-group kill reaches the roles and us) must not cut the
    # roles' shutdown short and orphan them.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def launch_local(cfg: TrainConfig, argv: list[str]) -> int:
    """Start all roles of `cfg`, wait for them, and return 0 only if every role succeeded."""
    port = free_port()
    world = cfg.world_size
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_TRAINER_ROOT, env.get("PYTHONPATH")]))
    # The working directory is the user's code (`--code-dir`), searched first once the
    # trainer's own packages are loaded; PYTHONSAFEPATH keeps `-m trainer` from finding a
    # user's own `trainer/` there first.
    env["PYTHONSAFEPATH"] = "1"
    env["OMP_NUM_THREADS"] = str(cfg.threads)
    # Roles always write metrics, so the summary has numbers even without --metrics-out.
    out = cfg.metrics_out or os.path.join(tempfile.mkdtemp(prefix="hybridtrain-"), "metrics.jsonl")
    parts = [f"{out}.rank{r}" for r in range(world)]
    for part in parts:
        Path(part).unlink(missing_ok=True)
    procs: list[subprocess.Popen | ForkedRole] = []
    start = time.monotonic()
    # A SIGTERM to the launcher (`timeout`, a CI job's cancel) stops the roles as Ctrl-C does:
    # they are its children, and left running they would hold the port and the CPU.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    what = f"script {cfg.script}" if cfg.script else f"task {cfg.task}"
    print(f"hybridtrain train: {what}, {cfg.strategy}, {cfg.workers} worker(s), world size {world}, "
          f"127.0.0.1:{port}", file=sys.stderr, flush=True)
    try:
        options, tail = (argv[: argv.index("--")], argv[argv.index("--") :]) if "--" in argv else (argv, [])
        if cfg.code_dir is None:
            options = [*options, "--code-dir", os.getcwd()]
        forking = _may_fork(cfg.threads)
        for rank in range(world):
            role_argv = [*options, "--role", _role_of(cfg, rank), "--rank", str(rank), "--world-size", str(world),
                         "--master-addr", "127.0.0.1", "--master-port", str(port),
                         "--metrics-out", parts[rank], *tail]
            if forking:
                procs.append(fork_role(role_argv, env))
            else:
                procs.append(subprocess.Popen([sys.executable, "-m", "trainer", *role_argv], env=env))
        status = _supervise(cfg, procs)
        if status:
            return status
    except KeyboardInterrupt:
        _stop(procs)
        print("hybridtrain train: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        records = _merge_metrics(out, parts)
        if not cfg.metrics_out:
            shutil.rmtree(os.path.dirname(out), ignore_errors=True)
    print(f"hybridtrain train: done. {_summary(cfg, records, time.monotonic() - start)}",
          file=sys.stderr, flush=True)
    return 0
