"""The peer baselines: `allreduce` (DDP) and `allreduce-powersgd` (DDP + PyTorch's PowerSGD hook).

Every rank is a worker. With unequal batches (explicit --batch-sizes from the control plane)
each rank's gradient is scaled by W * alpha_m in the comm hook before DDP averages it, so the
result is the alpha-weighted sum of eq. 2 whatever the user's loss does. Bytes are counted by
the same hook with the ring all-reduce model (each rank sends and receives 2(W-1)/W of each
all-reduced buffer to and from its ring neighbours), because gloo does not expose counters.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from hybridtrain.contract import ALLREDUCE_POWERSGD
from trainer.algorithm import float_buffers
from trainer.config import TrainConfig


class ByteCountingHook:
    """Wraps a DDP comm hook: scales the bucket to the worker's batch share, counts its bytes."""

    def __init__(self, world_size: int, scale: float, powersgd: psgd.PowerSGDState | None) -> None:
        self.world_size = world_size
        self.scale = scale
        self.powersgd = powersgd
        self.bucket_bytes = 0
        # When this step's first bucket was handed over, its last one, and when the last
        # all-reduce completed (perf_counter seconds; None before the step's first bucket).
        self.first_call: float | None = None
        self.last_call = 0.0
        self.last_done = 0.0

    def _payload_bytes(self, bucket: dist.GradBucket) -> int:
        state = self.powersgd
        if state is None or state.iter < state.start_powerSGD_iter:
            return bucket.buffer().numel() * bucket.buffer().element_size()
        # Mirrors powerSGD_hook: matrices worth compressing send P (n x r) and Q (m x r), the
        # rest is all-reduced as is.
        elements = 0
        for g in bucket.gradients():
            if g.dim() > 1:
                rows, cols = g.shape[0], g.numel() // g.shape[0]
                rank = min(rows, cols, state.matrix_approximation_rank)
                compress, _, _ = psgd._should_compress(rows, cols, rank, state.min_compression_rate)
                elements += (rows + cols) * rank if compress else g.numel()
            else:
                elements += g.numel()
        return elements * 4

    def __call__(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Scale, count, then run the wrapped hook, timing when its all-reduce completes."""
        now = time.perf_counter()
        if self.first_call is None:
            self.first_call = now
        self.last_call = now
        if self.scale != 1.0:
            bucket.buffer().mul_(self.scale)
        w = self.world_size
        self.bucket_bytes += int(self._payload_bytes(bucket) * 2 * (w - 1) / w)
        if self.powersgd is not None:
            fut = psgd.powerSGD_hook(self.powersgd, bucket)
        else:
            fut = default_hooks.allreduce_hook(None, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self.last_done = max(self.last_done, time.perf_counter())
            return f.value()

        return fut.then(done)

    def take(self) -> tuple[int, float, float]:
        """Since the last call: (bytes, seconds the all-reduces ran from the first bucket to the
        last completion, seconds of that not hidden behind the backward pass)."""
        n, self.bucket_bytes = self.bucket_bytes, 0
        if self.first_call is None:
            return n, 0.0, 0.0
        comm = max(0.0, self.last_done - self.first_call)
        exposed = max(0.0, self.last_done - self.last_call)
        self.first_call = None
        return n, comm, exposed


def wrap(model: nn.Module, cfg: TrainConfig, rank: int, batch_sizes: list[int],
         device: torch.device) -> tuple[DDP, ByteCountingHook]:
    """`model` inside DDP with the scaling, byte-counting (and PowerSGD) hook."""
    # PowerSGD chains several all-reduces per bucket from future callbacks; over gloo, two
    # buckets in flight can issue them in a different order on different ranks (a collective
    # mismatch), so on CPU the PowerSGD baseline runs with a single bucket.
    single_bucket = cfg.strategy == ALLREDUCE_POWERSGD and device.type != "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DDP(
            model,
            bucket_cap_mb=1 << 14 if single_bucket else None,
            device_ids=[device.index] if device.type == "cuda" else None,
            # Buffers are averaged by batch share before evaluation instead of broadcast from
            # rank 0 every forward.
            broadcast_buffers=False,
        )
    powersgd = None
    if cfg.strategy == ALLREDUCE_POWERSGD:
        powersgd = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=max(2, cfg.powersgd_start), random_seed=cfg.seed,
        )
    total = sum(batch_sizes)
    hook = ByteCountingHook(cfg.workers, cfg.workers * batch_sizes[rank] / total, powersgd)
    counting = hook

    # DDP checks the hook's annotations, so the counting object is wrapped in a plain function.
    def run_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return counting(state, bucket)

    # This module's annotations are strings (PEP 563); DDP compares the real classes.
    run_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(None, run_hook)
    return ddp, hook


def average_buffers(module: nn.Module, alpha: float) -> None:
    """BatchNorm statistics averaged by batch share over the ranks (before evaluation)."""
    for b in float_buffers(module):
        b.mul_(alpha)
        dist.all_reduce(b)


def combine_eval(sums: dict[str, float], count: int, device: torch.device) -> dict[str, float]:
    """Every rank's metric sums and counts summed; returns the means over the whole set."""
    names = sorted(sums)
    t = torch.tensor([*(sums[n] for n in names), count], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    total = max(1.0, float(t[-1]))
    return {n: float(t[i]) / total for i, n in enumerate(names)}


def powersgd_state(hook: ByteCountingHook) -> dict | None:
    """The PowerSGD state to checkpoint (its error feedback and warm start)."""
    return hook.powersgd.__getstate__() if hook.powersgd is not None else None


def load_powersgd_state(hook: ByteCountingHook, state: dict | None) -> None:
    """Restore `powersgd_state`."""
    if hook.powersgd is not None and state is not None:
        for slot, value in state.items():
            setattr(hook.powersgd, slot, value)
