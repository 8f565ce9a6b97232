"""The user's side of the trainer: a few calls that turn a plain PyTorch loop into a worker.

    import hybridtrain as ht
    ctx = ht.init(global_batch=64)
    model = ht.prepare_model(Net())
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    for x, y in ht.data_loader(train_set):
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        opt.step(loss=loss)
    ht.evaluate(model, test_set, metrics=[ht.accuracy()], loss=F.cross_entropy)

The launcher (`hybridtrain launch`, or a node agent) says through the environment which rank
this process is; the script names no rank, port or address. Run plainly (`python train.py`)
the same script trains as a single worker. The built-in task loop (`trainer.taskloop`) is
written with these same calls, so users' scripts and tasks share one code path.

The context is per process, like torch.distributed's default group.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from hybridtrain.contract import (
    ENV_CONFIG,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_RANK,
    ENV_ROLE,
    ENV_WORLD_SIZE,
    EVAL_S,
    parse_target,
)
from hybridtrain.task import Metric
from trainer import ddp as ddp_baseline
from trainer.config import TrainConfig, initial_batch_sizes
from trainer.devices import resolve_device
from trainer.evaluation import metric_sums
from trainer.loader import ShardedLoader, eval_slice
from trainer.metrics import HttpReporter, MetricsLogger

_current: Context | None = None


class WorkerLeft(SystemExit):
    """Raised from `step()` once a worker told to leave (SIGTERM, a spot notice) has left the
    run at the step boundary: the process ends with status 0, the run goes on."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Context:
    """Where this process stands in the run: its rank, device, batch share, step and stop flag."""

    def __init__(self, cfg: TrainConfig, *, rank: int, role: str, device: torch.device,
                 metrics: MetricsLogger, standalone: bool = False, fail_at_step: int | None = None) -> None:
        self.cfg, self.rank, self.role, self.device, self.metrics = cfg, rank, role, device, metrics
        self.standalone = standalone
        self.fail_at_step = fail_at_step
        self.step = 0
        self._stop = False
        self.batch_sizes = initial_batch_sizes(cfg)
        self.max_steps = cfg.max_steps
        self.target = parse_target(cfg.target) if cfg.target else None
        self.train_samples: int | None = None
        self.client: Any = None  # trainer.ps.PSClient once the optimizer is wrapped (PS strategies)
        self.ddp_hook: ddp_baseline.ByteCountingHook | None = None
        self.model: nn.Module | None = None
        self.reached_at: float | None = None
        self.elapsed_s = 0.0
        self._t0 = time.time()
        self._batch_ready_at: float | None = None
        self._data_s = 0.0
        self._last_print = 0.0
        self.finished = False
        # When SIGTERM (a spot notice) asked this worker to leave; None: it was not asked.
        self.leave_requested_at: float | None = None
        self.master_addr, self.master_port = "127.0.0.1", 0

    # -- what user code reads --------------------------------------------------------------------
    @property
    def should_stop(self) -> bool:
        """True once the run should end: its target was reached, the server ended it, or its
        --max-steps are done (so `while not ctx.should_stop:` loops end too)."""
        return self._stop or self.step >= self.max_steps

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._stop = bool(value)

    @property
    def worker(self) -> int:
        """This worker's 0-based index (rank - 1 under a parameter server)."""
        return self.rank - 1 if self.cfg.is_ps and not self.standalone else self.rank

    @property
    def workers(self) -> int:
        return self.cfg.workers

    @property
    def strategy(self) -> str:
        return self.cfg.strategy

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    @property
    def batch_size(self) -> int:
        """This worker's share of the global batch now (it follows re-balancing)."""
        return self.batch_sizes[self.worker]

    @property
    def is_first_worker(self) -> bool:
        return self.worker == 0

    def elapsed(self) -> float:
        """Training seconds so far, across resumes."""
        return self.elapsed_s + time.time() - self._t0

    # -- bookkeeping the calls below share ---------------------------------------------------------
    def _loader_state(self) -> tuple[int, int, int, Sequence[int], bool]:
        return self.step + 1, self.max_steps, self.worker, self.batch_sizes, self.should_stop

    def _batch_read(self, seconds: float) -> None:
        self._data_s += seconds
        self._batch_ready_at = time.perf_counter()

    def _note_eval(self, values: dict[str, float], stop: bool | None = None, seconds: float = 0.0) -> None:
        reached = self.target is not None and self.target.metric in values and self.target.reached(
            values[self.target.metric])
        self.should_stop = stop if stop is not None else (reached and self.cfg.stop_at_target)
        # The server logs a PS run's evaluation; otherwise the first worker does.
        logs = self.standalone or not self.cfg.is_ps and self.rank == 0
        if logs:
            for name, value in values.items():
                self.metrics.log(self.step, name, value)
            # The collective makes every rank's evaluation end with the slowest one's: this
            # rank's span is the evaluation's cost to the run.
            self.metrics.log(self.step, EVAL_S, seconds)
            if reached and self.reached_at is None:
                self.reached_at = self.elapsed()
                self.metrics.log(self.step, "time_to_target_s", self.reached_at)
        self.progress(values)

    def progress(self, values: dict[str, float] | None = None) -> None:
        """A line on stderr every few seconds (and at each evaluation), from the first worker
        (the server prints a PS run's)."""
        if self.worker != 0 or (self.cfg.is_ps and not self.standalone):
            return
        now = time.time()
        if values is None and now - self._last_print < 2.0 and self.step != self.max_steps:
            return
        self._last_print = now
        loss = self.metrics.last.get("loss", math.nan)
        extra = "".join(f" {k} {v:.4f}" for k, v in (values or {}).items())
        total = f"/{self.max_steps}" if self.max_steps < 10**9 else ""
        print(f"[{self.strategy} worker {self.worker}] step {self.step}{total} loss {loss:.4f}"
              f"{extra} elapsed {self.elapsed():.1f}s", file=sys.stderr, flush=True)

    # -- what DistributedOptimizer (trainer.distributed_optimizer) sets ---------------------------
    def restart_clock(self) -> None:
        """Training time counts from now (after DDP's start, or a client's join)."""
        self._t0 = time.time()

    def attach(self, client: Any) -> None:
        """Train through `client` (a PSClient), from where the run stands: a joiner, or a worker
        of a resumed run, starts at the run's step, batch split and step budget."""
        self.client = client
        self.step = client.step
        self.batch_sizes = list(client.batch_sizes)
        self.max_steps = client.max_steps
        self.should_stop = client.ended_by_server
        self.restart_clock()

    @property
    def evaluation_would_wait(self) -> bool:
        """Whether an evaluation now would first wait for an overlapped outer step's exchange
        (local SGD with --outer-delay): one taken after the step it lands after waits for nothing."""
        return self.client is not None and self.client.evaluation_would_wait()

    def step_started_at(self, default: float) -> float:
        """When this step's batch was read, `default` where the loop read none through
        `data_loader` (so its compute counts as 0 s)."""
        return self._batch_ready_at if self._batch_ready_at is not None else default

    def end_step(self, step: int) -> None:
        """Step `step` is done: log its data-wait seconds and reads, then count it."""
        self.metrics.log(step, "data_s", self._data_s)
        _log_data_reads(self, step)
        self._data_s = 0.0
        self._batch_ready_at = None
        self.step = step
        self.progress()

    def request_leave(self) -> None:
        """Leave the run at the next step boundary (a signal handler calls this)."""
        if self.leave_requested_at is None:
            self.leave_requested_at = time.monotonic()

    def finish(self) -> None:
        """Say goodbye to the server (PS) and flush the metrics; idempotent."""
        if self.finished:
            return
        self.finished = True
        if self.client is not None:
            self.client.close()


def current() -> Context:
    """The process's context; `init()` must have run."""
    if _current is None:
        raise RuntimeError("call hybridtrain.init() first")
    return _current


def bootstrap(cfg: TrainConfig, *, rank: int, role: str, world_size: int, master_addr: str,
              master_port: int, fail_at_step: int | None = None) -> Context:
    """Join the run's process group as a worker and make the process's context (launchers)."""
    global _current
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads)
    reporter = HttpReporter(cfg.report_url, cfg.report_token, spool=cfg.report_spool) if cfg.report_url else None
    metrics = MetricsLogger(rank, role, cfg.metrics_out, reporter)
    device = resolve_device(cfg.device, rank)
    # A parameter server's workers reach it over its own TCP transport (trainer.sockets), which
    # admits joiners; only the all-reduce baselines form a (fixed-size) process group.
    if not cfg.is_ps and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=cfg.timeout_s))
    _current = Context(cfg, rank=rank, role=role, device=device, metrics=metrics, fail_at_step=fail_at_step)
    _current.master_addr, _current.master_port = master_addr, master_port
    return _current


def init(**defaults: Any) -> Context:
    """This process's place in the run, from its launcher; run plainly, a single worker.

    Keyword arguments are defaults for a plain run (`global_batch`, `max_steps`, `device`,
    `seed`, ...: TrainConfig fields); under a launcher its settings win.
    """
    global _current
    if _current is not None:
        return _current
    if ENV_CONFIG in os.environ:
        cfg = TrainConfig.from_dict(json.loads(os.environ[ENV_CONFIG]))
        ctx = bootstrap(cfg, rank=int(os.environ[ENV_RANK]), role=os.environ.get(ENV_ROLE, "worker"),
                        world_size=int(os.environ[ENV_WORLD_SIZE]), master_addr=os.environ[ENV_MASTER_ADDR],
                        master_port=int(os.environ[ENV_MASTER_PORT]))
        atexit.register(ctx.finish)
        return ctx
    base = {"strategy": "allreduce", "workers": 1, "global_batch": 64, "max_steps": 10**9, "device": "cpu"}
    cfg = TrainConfig.from_dict(base | defaults | {"workers": 1})
    _current = Context(cfg, rank=0, role="worker", device=resolve_device(cfg.device, 0),
                       metrics=MetricsLogger(0, "worker", cfg.metrics_out), standalone=True)
    return _current


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def prepare_model(model: nn.Module) -> nn.Module:
    """`model` on this worker's device; for the all-reduce strategies inside DDP (whose start
    broadcasts the first worker's weights). Under a parameter server the replicas take the
    first worker's weights when the optimizer is wrapped."""
    ctx = current()
    model = model.to(ctx.device)
    ctx.model = model
    if ctx.standalone or ctx.cfg.is_ps:
        return model
    wrapped, hook = ddp_baseline.wrap(model, ctx.cfg, ctx.rank, ctx.batch_sizes, ctx.device)
    ctx.ddp_hook = hook
    ctx.restart_clock()
    return wrapped


def _log_data_reads(ctx: Context, step: int) -> None:
    """What this rank's data sets fetched since the last step, per data set (its id as the
    peer): `data_bytes` over the WAN from the store, `data_cache_bytes` from the site cache,
    and the samples its loader read with their digest (`hybridtrain.datasets.sample_digest`)."""
    from hybridtrain.datasets import DIGEST, FROM_SITE, FROM_STORE, SAMPLES, opened_datasets

    for ds in opened_datasets():
        reads = ds.take_reads()
        if reads[FROM_STORE]:
            ctx.metrics.log(step, "data_bytes", reads[FROM_STORE], peer=ds.access.id)
        if reads[FROM_SITE]:
            ctx.metrics.log(step, "data_cache_bytes", reads[FROM_SITE], peer=ds.access.id)
        if reads[SAMPLES]:
            ctx.metrics.log(step, "data_samples", reads[SAMPLES], peer=ds.access.id)
            ctx.metrics.log(step, "data_sample_digest", reads[DIGEST], peer=ds.access.id)


def data_loader(dataset: Any, *, collate: Callable | None = None, transform: Callable | None = None,
                workers: int | None = None, pin_memory: bool | None = None) -> ShardedLoader:
    """This worker's share of every global batch of `dataset` (a map-style or iterable torch
    data set); one iteration is one epoch, cut short at the run's last step or its target."""
    ctx = current()
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        ctx.train_samples = len(dataset)
    if workers is None:
        workers = ctx.cfg.data_workers or 0
    return ShardedLoader(dataset, ctx._loader_state, seed=ctx.cfg.seed, collate=collate, transform=transform,
                         workers=workers,
                         pin_memory=ctx.device.type == "cuda" if pin_memory is None else pin_memory,
                         on_batch=ctx._batch_read)


def evaluate(model: nn.Module, dataset: Any, *, metrics: Sequence[Metric] = (),
             loss: Callable[[Any, Any], Any] | None = None, batch_size: int = 512,
             collate: Callable | None = None) -> dict[str, float]:
    """The run's metrics on `dataset` (each worker scores its share; means over all of it), plus
    `val_loss` when `loss` is given. Logged, checked against the run's target
    (`ctx.should_stop`), and returned."""
    ctx = current()
    module = unwrap(model)
    started = time.perf_counter()
    n = None if isinstance(dataset, torch.utils.data.IterableDataset) else len(dataset)
    if ctx.standalone:
        sums, count = metric_sums(module, dataset, part=None, metrics=metrics, loss=loss,
                                  batch_size=batch_size, device=ctx.device, collate=collate)
        values = {k: v / max(1, count) for k, v in sums.items()}
        ctx._note_eval(values, seconds=time.perf_counter() - started)
        return values
    if n is None:
        lo = sum(ctx.batch_sizes[: ctx.worker])
        part: Any = (lo, lo + ctx.batch_size, ctx.global_batch)
    else:
        part = eval_slice(n, ctx.worker, ctx.batch_sizes)
    if ctx.client is not None:
        # An overlapped outer step still on its way lands first, and the buffers' mean waits for
        # the last worker to reach this evaluation: both are communication, not evaluation (the
        # benchmarks take the evaluations' seconds out of the time to target). Under local SGD
        # the workers meet only at outer steps, so the last one can be far behind: a cloud
        # worker still fetching the initial model over a 10 Mbit/s WAN made the first
        # evaluation "take" 48 s, and the time to target came out at 0.9 s.
        ctx.client.drain()
        # Under local SGD between outer steps, the common model's buffers are the ones averaged.
        with ctx.client.global_model():
            ctx.client.average_buffers(ctx.step)
            started = time.perf_counter()
            sums, count = metric_sums(module, dataset, part=part, metrics=metrics, loss=loss,
                                      batch_size=batch_size, device=ctx.device, collate=collate)
        values, stop = ctx.client.combine_eval(ctx.step, sums, count, time.perf_counter() - started)
        ctx._note_eval(values, stop)
        return values
    alpha = ctx.batch_size / ctx.global_batch
    with torch.no_grad():
        ddp_baseline.average_buffers(module, alpha)
    sums, count = metric_sums(module, dataset, part=part, metrics=metrics, loss=loss,
                              batch_size=batch_size, device=ctx.device, collate=collate)
    values = ddp_baseline.combine_eval(sums, count, ctx.device)
    ctx._note_eval(values, seconds=time.perf_counter() - started)
    return values


def reset_for_tests() -> None:
    """Forget the process's context (tests that build several in one process)."""
    global _current
    _current = None
