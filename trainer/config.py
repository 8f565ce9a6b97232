"""The frozen run configuration, strategy defaults, and the schedules (pure functions of step)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from trainer.allocation import equal_batch_sizes, proportional_batch_sizes

STRATEGIES = ("allreduce", "allreduce-powersgd", "ps", "ps-gc", "ps-bz-gc")
PS_STRATEGIES = ("ps", "ps-gc", "ps-bz-gc")
# Fields that a resumed run may change (where the files go, how fast it reports), all others
# must match the checkpoint's or the run would silently continue a different experiment.
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "target_accuracy", "checkpoint_every", "checkpoint_dir", "metrics_out",
     "report_url", "report_token", "threads", "timeout_s", "log_every", "device", "resume",
     "sites", "stop_at_target"}
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; saved in every checkpoint."""

    strategy: str = "ps-bz-gc"
    workers: int = 4
    global_batch: int = 64
    batch_sizes: tuple[int, ...] = ()
    speeds: tuple[float, ...] = ()
    allocation: str = "flops"
    rebalance_every: int = 50
    max_steps: int = 300
    target_accuracy: float | None = None
    # False: record the time to accuracy and train on to max_steps (to compare final accuracies
    # of runs at the same step budget).
    stop_at_target: bool = True
    seed: int = 0
    model: str = "smallcnn"
    dataset: str = "digits"
    lr: float = 0.1
    lr_schedule: str = "cosine"
    lr_warmup_steps: int = 10
    momentum: float = 0.9
    weight_decay: float = 5e-4
    compressor: str = "topk"
    value_dtype: str = "fp16"
    select: str = "estimate"
    density: float = 0.01
    density_min: float = 0.002
    density_max: float = 0.05
    density_gamma: float = 0.5
    # Transmission times below this count as equal: a few milliseconds on a fast link are
    # scheduling noise, and adapting to them swings densities between the bounds for nothing.
    density_time_floor_s: float = 0.05
    server_k_fraction: float = 1 / 32
    error_feedback: bool = True
    # DGC's momentum correction: compressing strategies accumulate momentum on the workers,
    # before compression, instead of applying it to the sparse update (trainer.ps).
    momentum_correction: bool = True
    warmup_steps: int = 5
    # PS strategies: the compressed part travels in this many chunks, pipelined (trainer.ps).
    pipeline_chunks: int = 1
    dense_numel: int = 1024
    eval_every: int = 50
    checkpoint_every: int = 0
    checkpoint_dir: str = "checkpoints"
    resume: bool = False
    metrics_out: str | None = None
    report_url: str | None = None
    report_token: str | None = None
    threads: int = 1
    device: str = "cpu"
    timeout_s: float = 300.0
    log_every: int = 0
    link_mbps: tuple[float, ...] = ()
    # Site label per rank (0 the server): the server's update crosses to each remote site once.
    sites: tuple[str, ...] = ()
    emulate_speeds: bool = False
    powersgd_rank: int = 2
    powersgd_start: int = 10

    @property
    def is_ps(self) -> bool:
        """Whether rank 0 is a parameter server."""
        return self.strategy in PS_STRATEGIES

    @property
    def compresses(self) -> bool:
        """Whether gradients are sparsified (`ps-gc`, `ps-bz-gc` unless --compressor none)."""
        return self.strategy in ("ps-gc", "ps-bz-gc") and self.compressor != "none"

    @property
    def world_size(self) -> int:
        """Processes in the run: the workers, plus the server for PS strategies."""
        return self.workers + (1 if self.is_ps else 0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (for checkpoints and logs)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """The inverse of `to_dict`, ignoring unknown keys from newer versions."""
        names = {f.name for f in fields(cls)}
        clean = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in names}
        return cls(**clean)


def default_allocation(strategy: str) -> str:
    """`ps-bz-gc` sizes batches by speed; every baseline uses equal batches."""
    return "flops" if strategy == "ps-bz-gc" else "equal"


def initial_batch_sizes(cfg: TrainConfig) -> list[int]:
    """Step 1: explicit --batch-sizes win; else equal, or proportional to --speeds."""
    if cfg.batch_sizes:
        return list(cfg.batch_sizes)
    if cfg.allocation in ("flops", "measured") and cfg.speeds:
        return proportional_batch_sizes(cfg.global_batch, cfg.speeds)
    return equal_batch_sizes(cfg.global_batch, cfg.workers)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at 1-based `step`: linear warm-up, then constant or cosine to zero."""
    if cfg.lr_warmup_steps > 0 and step <= cfg.lr_warmup_steps:
        return cfg.lr * step / cfg.lr_warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, cfg.max_steps - cfg.lr_warmup_steps)
    progress = min(1.0, (step - cfg.lr_warmup_steps) / span)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def adapt_densities(
    densities: list[float],
    times: list[float],
    *,
    target: float,
    low: float,
    high: float,
    gamma: float,
    floor: float = 0.0,
) -> list[float]:
    """Step 3, the per-worker density rule: d_m <- d_m * (mean(T) / T_m)^gamma, renormalised.

    A worker whose last transmission took longer than the mean compresses harder, a faster one
    lighter. The geometric mean is then pinned to `target` so the total budget does not drift
    (the arithmetic mean in the ratio would otherwise push every density up), and each density is
    clipped to [low, high]. With bytes proportional to density the fixed point is d_m
    proportional to the link's bandwidth. Times are raised to `floor` first, so links too fast
    for their time to matter keep the target. Missing or non-positive times leave densities as
    they are.
    """
    if len(densities) != len(times):
        raise ValueError(f"{len(densities)} densities but {len(times)} transmission times")
    if not densities or any(not (t > 0) for t in times):
        return [min(high, max(low, d)) for d in densities]
    times = [max(t, floor) for t in times]
    mean = sum(times) / len(times)
    proposed = [d * (mean / t) ** gamma for d, t in zip(densities, times)]
    geo = math.exp(sum(math.log(p) for p in proposed) / len(proposed))
    return [min(high, max(low, p * target / geo)) for p in proposed]
