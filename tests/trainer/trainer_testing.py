"""Helpers for the trainer tests: the CLI as a subprocess, and a whole PS run in one process
(server and workers on threads over an in-memory hub) for exact-arithmetic specifications."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from trainer.config import TrainConfig, initial_batch_sizes
from trainer.loader import batch_indices
from trainer.metrics import MetricsLogger
from trainer.ps import PSClient
from trainer.server import ParameterServer, serve_in_thread
from trainer.transport import InMemoryHub, Transport
from zygote import ForkedProcess, Zygote

ROOT = Path(__file__).resolve().parents[2]
# The built-in task the CLI tests train: quick on a CPU, and learnable to > 90 %.
DIGITS = ["--task", "hybridtrain.tasks.digits:smallcnn", "--task-args", '{"lr": 0.1}', "--global-batch", "48"]


def run_cli(*args: str, timeout: float = 150, cwd: Path = ROOT, command: str = "trainer") -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` (or `hybridtrain launch` with command="launch") with one thread
    per role; returns the finished process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if command == "launch":
        argv = [sys.executable, "-c", "import sys; from trainer.cli import launch_main; sys.exit(launch_main(sys.argv[1:]))",
                "--threads", "1", *args]
    else:
        argv = [sys.executable, "-m", "trainer", "--threads", "1", *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(path: Path) -> list[dict]:
    """The JSON-lines records of a run."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], name: str, rank: int = 0) -> dict[int, float]:
    """step -> value of one metric of one rank."""
    return {r["step"]: r["value"] for r in records if r.get("name") == name and r["rank"] == rank}


def tiny_data(n: int = 256, features: int = 12, seed: int = 0) -> TensorDataset:
    """A learnable 3-class problem small enough for exact-arithmetic comparisons."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=gen)
    w = torch.randn(features, 3, generator=gen)
    return TensorDataset(x, (x @ w).argmax(1))


def tiny_mlp(features: int = 12, seed: int = 0) -> nn.Module:
    """No BatchNorm: the gradient of a concatenated batch is then exactly the weighted sum."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, 3))


def sgd(model: nn.Module, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-3) -> torch.optim.SGD:
    """SGD with weight decay on the matrices only, as the built-in tasks build it."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                           lr=lr, momentum=momentum)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """A model's parameters as one flat vector (to compare replicas)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def plain_sgd(model: nn.Module) -> torch.optim.SGD:
    """SGD at 0.1 without momentum or decay: an inner step that is easy to compute by hand."""
    return torch.optim.SGD(model.parameters(), lr=0.1)


def adamw(model: nn.Module) -> torch.optim.AdamW:
    """AdamW at 1e-2, the optimizer local SGD's users train with."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def global_batch(data: TensorDataset, step: int, sizes: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of every worker's batch of `step` (what one large-batch step sees)."""
    idx = torch.cat([batch_indices(step, m, sizes, len(data), seed) for m in range(len(sizes))])
    return data.tensors[0][idx], data.tensors[1][idx]


@dataclass
class Run:
    """What an in-process run leaves: each worker's model, optimizer and client, the server,
    the hub (frames per link)."""

    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    clients: list[PSClient]
    server: ParameterServer
    hub: InMemoryHub
    losses: dict[int, list[float]] = field(default_factory=dict)


class RankLost(BaseException):
    """Raised inside a worker's thread to end it as a lost process would end (no goodbye)."""


def run_in_process(
    cfg: TrainConfig,
    steps: int,
    *,
    data: TensorDataset | None = None,
    model: Callable[[int], nn.Module] = lambda rank: tiny_mlp(),
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = sgd,
    eval_at: tuple[int, ...] = (),
    after_step: Callable[[int, int, Run], None] | None = None,
    transport: Callable[[InMemoryHub, int], Transport] = lambda hub, rank: hub.transport(rank),
) -> Run:
    """Train `steps` steps of `cfg` with a server and cfg.workers workers on threads; a worker
    whose `transport` raises RankLost is lost to the run (its thread ends quietly)."""
    data = data if data is not None else tiny_data()
    hub = InMemoryHub(timeout_s=30)
    server = ParameterServer(cfg, hub.transport(0), MetricsLogger(0, "ps"))
    thread, server_errors = serve_in_thread(server)
    models = [model(r) for r in range(1, cfg.workers + 1)]
    optimizers = [optimizer(m) for m in models]
    clients: list[PSClient | None] = [None] * cfg.workers
    # A callback reads `run.clients[rank - 1]` during the run; at the end the lost ones drop out.
    run = Run(models, optimizers, clients, server, hub)  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            m, opt = models[rank - 1], optimizers[rank - 1]
            client = PSClient(cfg, rank, transport(hub, rank), m, opt, MetricsLogger(rank, "worker"),
                              train_samples=len(data))
            clients[rank - 1] = client
            client.start()
            for step in range(1, steps + 1):
                idx = batch_indices(step, rank - 1, client.batch_sizes, len(data), cfg.seed)
                client.zero_grad()
                loss = F.cross_entropy(m(data.tensors[0][idx]), data.tensors[1][idx])
                loss.backward()
                client.push_pull(step, loss=float(loss.detach()), samples=len(idx), compute_s=0.0)
                run.losses.setdefault(rank, []).append(float(loss.detach()))
                if after_step is not None:
                    after_step(rank, step, run)
                if step in eval_at:
                    client.average_buffers(step)
                    client.combine_eval(step, {"accuracy": 0.0}, 1)
            client.close()
        except RankLost:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(1, cfg.workers + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    thread.join(30)
    if errors or server_errors:
        raise (errors or server_errors)[0]
    run.clients = [c for c in clients if c is not None]
    return run


def config(**overrides) -> TrainConfig:
    """A TrainConfig for the in-process runs (batch sizes as the server will plan them)."""
    cfg = TrainConfig(**overrides)
    assert sum(initial_batch_sizes(cfg)) == cfg.global_batch
    return cfg


_zygote: Zygote | None = None


def zygote() -> Zygote:
    """The session's zygote (tests/zygote.py), started on first use and stopped at exit."""
    global _zygote
    if _zygote is None:
        import atexit
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="hybridtrain-zygote-"))
        _zygote = Zygote(directory, dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
        atexit.register(_zygote.close)
    return _zygote


class Role:
    """One role of a run as its own process (`python -m trainer --role ...`), its stderr read
    line by line on a thread so a test can wait for a line. The process is forked from the
    session's zygote, which has imported torch already, unless `prefix` is given (what the
    process runs under: `ip netns exec NS` for a worker across a link), which starts a fresh
    interpreter."""

    def __init__(self, role: str, rank: int, world_size: int, port: int, args: list[str], *, metrics: Path,
                 cwd: Path = ROOT, master_addr: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.rank = rank
        self.lines: list[str] = []
        self.metrics = metrics
        options, tail = (args[: args.index("--")], args[args.index("--"):]) if "--" in args else (args, [])
        command = ["--threads", "1", *options, "--role", role, "--rank", str(rank), "--world-size", str(world_size),
                   "--master-addr", master_addr, "--master-port", str(port), "--metrics-out", str(metrics), *tail]
        self.proc: subprocess.Popen | ForkedProcess
        if not prefix:
            self.proc = zygote().spawn(command, cwd=cwd, env=env)
        else:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "trainer", *command], cwd=cwd, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 90.0) -> str:
        """The first output line containing `text`, waiting for it."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hit = next((line for line in self.lines if text in line), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"rank {self.rank} never printed {text!r}; it printed:\n" + "\n".join(self.lines[-30:]))

    def wait(self, timeout: float = 120.0) -> int:
        """The exit status (the process is killed if it outlives `timeout`)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def records(self) -> list[dict]:
        """This role's metric records (once it has exited)."""
        return read_metrics(self.metrics) if self.metrics.exists() else []


def start_ps_run(tmp_path: Path, workers: int, args: list[str], *, ranks: list[int] | None = None,
                 cwd: Path = ROOT, master_addr: str = "127.0.0.1") -> tuple[Role, dict[int, Role], int]:
    """A parameter-server run as separate role processes on a free port: (server, workers by
    rank, port)."""
    from trainer.launch import free_port

    port = free_port()
    world = workers + 1
    server = Role("ps", 0, world, port, args, metrics=tmp_path / "rank0.jsonl", cwd=cwd, master_addr=master_addr)
    roles = {r: Role("worker", r, world, port, args, metrics=tmp_path / f"rank{r}.jsonl", cwd=cwd,
                     master_addr=master_addr)
             for r in (ranks or range(1, workers + 1))}
    return server, roles, port


def stop_all(*roles: Role) -> None:
    """Kill whatever is still running (a failed test must leave no process behind)."""
    for role in roles:
        if role.proc.poll() is None:
            role.proc.kill()
            role.proc.wait()


def events(records: list[dict], kind: str) -> list[dict]:
    """The run events of one kind."""
    return [r for r in records if r.get("event") == kind]


# A script of the user's own that trains the run's task through the task loop, then prints a
# hash of its final weights and of its error-feedback residual: the replicas compared by it.
REPLICA_SCRIPT = """
import hashlib, json
import torch
import hybridtrain as ht
from hybridtrain.task import load_task
from trainer import loop
from trainer.taskloop import run_task

ctx = ht.init()
run_task(ctx, task=load_task(ctx.cfg.task, json.loads(ctx.cfg.task_args)))


def digest(t):
    return "-" if t is None else hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


flat = torch.cat([p.detach().reshape(-1) for p in loop.unwrap(ctx.model).parameters()])
residual = ctx.client.state_dict()["residual"] if ctx.client is not None else None
print(f"REPLICA {ctx.rank} {digest(flat)} {digest(residual)}", flush=True)
"""


def replica_hashes(stdout: str) -> dict[int, tuple[str, str]]:
    """rank -> (weights hash, residual hash) from REPLICA_SCRIPT's lines."""
    # The workers share one stdout: two lines may arrive run together, so match anywhere. A
    # strategy without error feedback has no residual and prints "-" for it.
    rows = re.findall(r"REPLICA (\d+) ([0-9a-f]{16}) ([0-9a-f]{16}|-)", stdout)
    return {int(rank): (weights, residual) for rank, weights, residual in rows}


def with_replica_script(tmp_path: Path) -> list[str]:
    """The options that run REPLICA_SCRIPT (written into `tmp_path`) instead of the task loop."""
    (tmp_path / "replica.py").write_text(REPLICA_SCRIPT)
    return ["--script", str(tmp_path / "replica.py"), "--code-dir", str(tmp_path)]
