"""The peer baselines: `allreduce` (DDP) and `allreduce-powersgd` (DDP + PyTorch's PowerSGD hook).

Every rank is a worker. Batches are equal unless the control plane passes explicit
`--batch-sizes`; then each rank scales its mean loss by W * alpha_m, so DDP's average of the
gradients is the alpha-weighted sum of eq. 2. Bytes are counted by a wrapping comm hook with
the ring all-reduce model (each rank sends and receives 2(W-1)/W of each all-reduced buffer to
and from its ring neighbours), because gloo does not expose its own counters.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer import checkpoint
from trainer.allocation import aggregation_weights
from trainer.config import TrainConfig, lr_at
from trainer.data import Dataset, batch_indices, eval_slice
from trainer.metrics import MetricsLogger
from trainer.ps import CPU, float_buffers


class ByteCountingHook:
    """Wraps a DDP comm hook and adds the bytes each bucket puts on the ring."""

    def __init__(self, world_size: int, powersgd: psgd.PowerSGDState | None) -> None:
        self.world_size = world_size
        self.powersgd = powersgd
        self.bucket_bytes = 0

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
        """Count, then run the wrapped hook."""
        w = self.world_size
        self.bucket_bytes += int(self._payload_bytes(bucket) * 2 * (w - 1) / w)
        if self.powersgd is not None:
            return psgd.powerSGD_hook(self.powersgd, bucket)
        return default_hooks.allreduce_hook(None, bucket)

    def take(self) -> int:
        """Bytes counted since the last call."""
        n, self.bucket_bytes = self.bucket_bytes, 0
        return n


class DDPWorker:
    """A data-parallel peer: `run_step`, `evaluate`, `save_checkpoint`, `train`."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        model: nn.Module,
        data: Dataset,
        metrics: MetricsLogger,
        batch_sizes: list[int],
        device: torch.device = CPU,
    ) -> None:
        self.cfg, self.rank, self.data, self.metrics, self.device = cfg, rank, data, metrics, device
        self.world = cfg.workers
        self.batch_sizes = list(batch_sizes)
        self.module = model.to(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.model = self._wrap()
        self.powersgd = None
        if cfg.strategy == "allreduce-powersgd":
            self.powersgd = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
                start_powerSGD_iter=max(2, cfg.powersgd_start), random_seed=cfg.seed,
            )
        self.hook = ByteCountingHook(self.world, self.powersgd)
        counting = self.hook

        # DDP checks the hook's annotations, so the counting object is wrapped in a plain function.
        def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return counting(state, bucket)

        # This module's annotations are strings (PEP 563); DDP compares the real classes.
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        self.model.register_comm_hook(None, hook)
        decay = [p for p in self.module.parameters() if p.dim() > 1]
        no_decay = [p for p in self.module.parameters() if p.dim() <= 1]
        # Replicas are identical, so decay in the optimizer equals decay in each local gradient.
        self.optimizer = torch.optim.SGD(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, momentum=cfg.momentum,
        )
        self.x_train, self.y_train = data.x_train.to(device), data.y_train.to(device)
        self.stopped = False
        self.reached_at: float | None = None
        self.elapsed_s = 0.0
        self._t0 = time.time()
        self._last_print = 0.0

    def _wrap(self) -> DDP:
        # PowerSGD chains several all-reduces per bucket from future callbacks; over gloo, two
        # buckets in flight can issue them in a different order on different ranks (a collective
        # mismatch), so on CPU the PowerSGD baseline runs with a single bucket.
        single_bucket = self.cfg.strategy == "allreduce-powersgd" and self.device.type != "cuda"
        return DDP(
            self.module,
            bucket_cap_mb=1 << 14 if single_bucket else None,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            # Buffers are averaged by batch share before evaluation instead of broadcast from
            # rank 0 every forward.
            broadcast_buffers=False,
        )

    def run_step(self, step: int) -> float:
        """Forward, backward (DDP all-reduces inside), optimizer step; returns the local loss."""
        t0 = time.perf_counter()
        idx = batch_indices(step, self.rank, tuple(self.batch_sizes), len(self.y_train), self.cfg.seed)
        x, y = self.x_train[idx.to(self.device)], self.y_train[idx.to(self.device)]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        scale = self.world * aggregation_weights(self.batch_sizes)[self.rank]
        (loss * scale).backward()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        nbytes = self.hook.take()
        w = self.world
        mlog = self.metrics.log
        mlog(step, "loss", float(loss.item()))
        mlog(step, "batch_size", len(idx))
        mlog(step, "samples_per_s", len(idx) / elapsed)
        mlog(step, "compute_s", elapsed)
        if w > 1:
            mlog(step, "bytes_sent", nbytes, peer=(self.rank + 1) % w)
            mlog(step, "bytes_recv", nbytes, peer=(self.rank - 1) % w)
        if self.rank == 0:
            self._progress(step, float(loss.item()))
        if step % self.cfg.eval_every == 0 or step == self.cfg.max_steps:
            self.evaluate(step)
        return float(loss.item())

    def elapsed(self) -> float:
        """Training seconds so far, across resumes."""
        return self.elapsed_s + time.time() - self._t0

    def _progress(self, step: int, loss: float, accuracy: float | None = None) -> None:
        now = time.time()
        if accuracy is None and now - self._last_print < 2.0 and step != self.cfg.max_steps:
            return
        self._last_print = now
        acc = f" accuracy {accuracy:.4f}" if accuracy is not None else ""
        print(f"[{self.cfg.strategy}] step {step}/{self.cfg.max_steps} loss {loss:.4f}{acc} "
              f"elapsed {self.elapsed():.1f}s", file=sys.stderr, flush=True)

    @torch.no_grad()
    def evaluate(self, step: int) -> float:
        """Average BatchNorm buffers by batch share, score a slice each, sum the counts."""
        alpha = aggregation_weights(self.batch_sizes)[self.rank]
        for b in float_buffers(self.module):
            b.mul_(alpha)
            dist.all_reduce(b)
        part = eval_slice(len(self.data.y_test), self.rank, tuple(self.batch_sizes))
        x, y = self.data.x_test[part], self.data.y_test[part]
        self.module.eval()
        correct = 0
        for i in range(0, len(y), 1024):
            correct += int((self.module(x[i : i + 1024].to(self.device)).argmax(1).cpu() == y[i : i + 1024]).sum())
        counts = torch.tensor([correct, len(y)], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        accuracy = float(counts[0] / counts[1].clamp(min=1))
        target = self.cfg.target_accuracy
        reached = target is not None and accuracy >= target
        self.stopped = reached and self.cfg.stop_at_target
        if self.rank == 0:
            self.metrics.log(step, "accuracy", accuracy)
            if reached and self.reached_at is None:
                self.reached_at = self.elapsed()
                self.metrics.log(step, "time_to_accuracy_s", self.reached_at)
            self._progress(step, self.metrics.last.get("loss", float("nan")), accuracy)
        return accuracy

    def state_dict(self) -> dict:
        """Model, optimizer, PowerSGD state (its error feedback and warm start), elapsed time."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "powersgd": self.powersgd.__getstate__() if self.powersgd is not None else None,
            "batch_sizes": self.batch_sizes,
            "elapsed_s": self.elapsed(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.powersgd is not None and state["powersgd"] is not None:
            for slot, value in state["powersgd"].items():
                setattr(self.powersgd, slot, value)
        self.batch_sizes = list(state["batch_sizes"])
        self.elapsed_s = state["elapsed_s"]
        self._t0 = time.time()

    def save_checkpoint(self, step: int) -> None:
        """This rank's state of `step`."""
        checkpoint.save(self.cfg.checkpoint_dir, step, self.rank, self.state_dict(), self.cfg)

    def train(self, start_step: int = 0) -> None:
        """Steps start_step+1 .. max_steps, evaluating and checkpointing on schedule."""
        self._t0 = time.time()
        for step in range(start_step + 1, self.cfg.max_steps + 1):
            self.run_step(step)
            last = self.stopped or step == self.cfg.max_steps
            if self.cfg.checkpoint_every and (step % self.cfg.checkpoint_every == 0 or last):
                self.save_checkpoint(step)
            if self.stopped:
                break
