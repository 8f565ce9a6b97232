"""`DistributedOptimizer`: the user's optimizer, whose `step()` is the run's synchronisation.

Under a parameter server it holds the worker's client (trainer.ps.PSClient) and each `step()`
is the push and pull (or, for the local-SGD strategies, an inner step with the outer sync inside
the H-th); under the all-reduce baselines DDP has already averaged the gradients in the backward
pass and `step()` is the wrapped optimizer's. It reads and moves the process's `Context`
(trainer.loop) only through the context's own methods.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer.loop import Context, WorkerLeft, current, unwrap


class DistributedOptimizer:
    """Wraps any torch optimizer: `step()` is the run's synchronisation (the paper's compressed
    push and pull under a parameter server; DDP has already all-reduced for the baselines).

    Build LR schedulers on the optimizer you pass in: its parameter groups are used as they are.
    Other attributes (param_groups, state_dict, ...) are the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
        ctx = current()
        self.optimizer = optimizer
        self.ctx = ctx
        module = unwrap(model) if model is not None else ctx.model
        if module is None:
            raise RuntimeError("DistributedOptimizer needs the model: pass it, or call prepare_model first")
        self.module = module
        if ctx.cfg.is_ps and not ctx.standalone:
            ctx.attach(_start_client(ctx, module, optimizer))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (under a PS they stay views of one flat buffer)."""
        if self.ctx.client is not None:
            self.ctx.client.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> None:
        """One synchronous step of the run; `loss` (optional) is charted."""
        ctx = self.ctx
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure: compute the loss and "
                             "call backward() before step()")
        step = ctx.step + 1
        if ctx.fail_at_step == step:
            raise RuntimeError(f"injected failure at step {step} (--inject-failure)")
        now = time.perf_counter()
        compute_s = now - ctx.step_started_at(now)
        if ctx.cfg.emulate_speeds and ctx.worker < len(ctx.cfg.speeds):
            # Stretch compute to what a device of relative speed s_m would take.
            slow = max(ctx.cfg.speeds) / ctx.cfg.speeds[ctx.worker]
            time.sleep(compute_s * (slow - 1.0))
            compute_s *= slow
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else (math.nan if loss is None else float(loss))
        if ctx.client is not None:
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            ctx.client.push_pull(step, loss=value, samples=ctx.batch_size, compute_s=compute_s)
            ctx.batch_sizes = list(ctx.client.batch_sizes)
        else:
            self.optimizer.step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            _log_local_step(ctx, step, value, elapsed=time.perf_counter() - ctx.step_started_at(now))
        ctx.end_step(step)
        if ctx.client is not None and ctx.client.ended_by_server:
            ctx.should_stop = True
        if ctx.leave_requested_at is not None and ctx.client is not None:
            ctx.client.leave()
            ctx.finished = True
            after = time.monotonic() - ctx.leave_requested_at
            raise WorkerLeft(f"left the run after step {step} (SIGTERM: a spot notice, {after:.2f} s after it); "
                             "the run goes on")


def _start_client(ctx: Context, module: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """This worker's PSClient, connected to the run's server and started (joined, or resumed)."""
    from trainer.linktls import LinkTls
    from trainer.ps import PSClient
    from trainer.sockets import JOIN_CONNECT_S, WorkerSocketTransport
    from trainer.transport import ThrottledTransport

    cfg = ctx.cfg
    transport: Any = WorkerSocketTransport(ctx.rank, ctx.master_addr, ctx.master_port, timeout_s=cfg.timeout_s,
                                           listen=bool(cfg.sites), tls=LinkTls.given(cfg.link_secret),
                                           sites=cfg.sites, connect_s=JOIN_CONNECT_S if cfg.join else None)
    if ctx.worker < len(cfg.link_mbps):
        transport = ThrottledTransport(transport, cfg.link_mbps[ctx.worker], peer=0)
    client = PSClient(cfg, ctx.rank, transport, module, optimizer, ctx.metrics, device=ctx.device,
                      train_samples=ctx.train_samples)
    client.start()
    return client


def _log_local_step(ctx: Context, step: int, loss: float, *, elapsed: float) -> None:
    """A step that did not go through a server: its loss, batch, throughput and, under DDP, the
    all-reduces' bytes and time."""
    mlog, samples, w = ctx.metrics.log, ctx.batch_size, ctx.workers
    if math.isfinite(loss):
        mlog(step, "loss", loss)
    mlog(step, "batch_size", samples)
    mlog(step, "samples_per_s", samples / max(elapsed, 1e-9))
    if ctx.ddp_hook is not None and w > 1:
        nbytes, comm_s, exposed_s = ctx.ddp_hook.take()
        # DDP all-reduces during the backward pass: communication is the all-reduces' span,
        # compute the step less the part of it the backward pass did not hide.
        mlog(step, "compute_s", max(0.0, elapsed - exposed_s))
        mlog(step, "comm_s", comm_s)
        mlog(step, "bytes_sent", nbytes, peer=(ctx.rank + 1) % w)
        mlog(step, "bytes_recv", nbytes, peer=(ctx.rank - 1) % w)
    else:
        mlog(step, "compute_s", elapsed)
