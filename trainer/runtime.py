"""Runs one role (server or worker) of a run: process group, data, model, resume, train."""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer import checkpoint
from trainer.config import TrainConfig, initial_batch_sizes
from trainer.data import load_dataset
from trainer.metrics import HttpReporter, MetricsLogger
from trainer.models import build_model

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class RoleSpec:
    """Which process this is, and where the rendezvous is."""

    role: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    fail_at_step: int | None = None


def resolve_device(name: str, rank: int) -> torch.device:
    """cpu, cuda (one GPU per local rank, round robin) or auto."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _fail_at(obj: object, step_to_fail: int) -> None:
    run_step = obj.run_step

    def failing(step: int) -> float:
        if step == step_to_fail:
            raise RuntimeError(f"injected failure at step {step} (--inject-failure)")
        return run_step(step)

    obj.run_step = failing


def run_role(cfg: TrainConfig, spec: RoleSpec) -> int:
    """Train as `spec.role`; returns the exit status (0 on success) and says why on failure."""
    from trainer.ddp import DDPWorker
    from trainer.ps import Layout, ParameterServer, PSWorker, float_buffers
    from trainer.transport import ThrottledTransport, TorchTransport

    torch.set_num_threads(cfg.threads)
    reporter = HttpReporter(cfg.report_url, cfg.report_token) if cfg.report_url else None
    metrics = MetricsLogger(spec.rank, spec.role, cfg.metrics_out, reporter)
    name = f"{spec.role} rank {spec.rank}"
    try:
        device = resolve_device(cfg.device, spec.rank)
        server = cfg.is_ps and spec.rank == 0
        backend = "nccl" if (not cfg.is_ps and device.type == "cuda") else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
            rank=spec.rank, world_size=spec.world_size, timeout=timedelta(seconds=cfg.timeout_s),
        )
        data = load_dataset(cfg.dataset)
        model = build_model(cfg.model, data.input_shape, data.num_classes, seed=cfg.seed)
        batch_sizes = initial_batch_sizes(cfg)
        if server:
            obj = ParameterServer(cfg, Layout.of(model, cfg.dense_numel), TorchTransport(0), metrics,
                                  batch_sizes, has_buffers=bool(float_buffers(model)))
        elif cfg.is_ps:
            transport = TorchTransport(spec.rank)
            if cfg.link_mbps:
                transport = ThrottledTransport(transport, cfg.link_mbps[spec.rank - 1], peer=0)
            obj = PSWorker(cfg, spec.rank, model, data, transport, metrics, batch_sizes, device)
        else:
            obj = DDPWorker(cfg, spec.rank, model, data, metrics, batch_sizes, device)
        start = checkpoint.agreed_resume_step(cfg.checkpoint_dir, spec.rank) if cfg.resume else 0
        if start:
            obj.load_state_dict(checkpoint.load(cfg.checkpoint_dir, start, spec.rank, cfg))
            print(f"[{name}] resumed from step {start}", file=sys.stderr, flush=True)
        if spec.fail_at_step is not None:
            _fail_at(obj, spec.fail_at_step)
        # Every role starts its training clock only once all have built their data and model:
        # otherwise the server's clock (PS) ran through a slow worker's start-up (seconds on a
        # small node) while DDP's began after its constructor had synchronised the ranks, and
        # time to accuracy compared start-up costs as much as training.
        dist.barrier()
        obj.train(start)
    except KeyboardInterrupt:
        print(f"[{name}] interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:
        log.debug("role failed", exc_info=True)
        print(f"[{name}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            traceback.print_exc()
        return 1
    finally:
        metrics.close()
    # DDP's reducer holds the process group and gloo work; left to interpreter finalisation it
    # is torn down after the group and aborts the process ("terminate called without an active
    # exception", about one run in three on torch 2.14). Release it while the group is alive.
    del obj, model
    gc.collect()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the run is over; a teardown hiccup must not fail it
        log.debug("process group teardown failed", exc_info=True)
    return 0
