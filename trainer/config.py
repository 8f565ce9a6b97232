"""The frozen run configuration and the initial batch split."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from hybridtrain.contract import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_DENSITY,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_STRATEGY,
    DEFAULT_SYNC_EVERY,
    DEFAULT_TASK,
    PS_STRATEGIES,
    STRATEGIES,
    compresses,
    default_allocation,
    equal_batch_sizes,
    is_local_sgd,
    outer_density_plan,
    proportional_batch_sizes,
    sync_fragments,
)

__all__ = ["PS_STRATEGIES", "RESUMABLE_CHANGES", "SECRET_FIELDS", "STRATEGIES", "TrainConfig", "default_allocation",
           "initial_batch_sizes"]
# Fields that a resumed run may change (where the files go, how fast it reports, its workers), all others
# must match the checkpoint's or the run would silently continue a different experiment.
RESUMABLE_CHANGES = frozenset(
    {"max_steps", "epochs", "target", "checkpoint_every", "checkpoint_dir", "metrics_out",
     "report_url", "report_token", "threads", "timeout_s", "log_every", "device", "resume",
     "sites", "stop_at_target", "data_workers", "eval_every", "code_dir", "checkpoint_every_s",
     "checkpoint_url", "report_spool", "link_secret", "min_workers", "min_workers_wait_s", "start_wait_s", "join",
     "expect_ranks",
     # A run resumes with whichever workers it has now (docs/elastic.md).
     "workers", "batch_sizes", "speeds", "link_mbps", "emulate_speeds"}
)


# Fields that are credentials: left out of what is written to disk (checkpoints).
SECRET_FIELDS = frozenset({"report_token", "link_secret"})


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run; saved in every checkpoint."""

    strategy: str = DEFAULT_STRATEGY
    workers: int = 4
    global_batch: int = 64
    batch_sizes: tuple[int, ...] = ()
    speeds: tuple[float, ...] = ()
    allocation: str = "flops"
    rebalance_every: int = 50
    max_steps: int = 300
    # Set: the run lasts this many passes over the task's training data instead (the server
    # turns it into steps once the workers have said how large their data is).
    epochs: float | None = None
    # "accuracy>=0.9", "val_loss<=0.3": an evaluation metric of the task and where it must get.
    target: str | None = None
    # False: record the time to the target and train on to max_steps (to compare final metrics
    # of runs at the same step budget).
    stop_at_target: bool = True
    seed: int = 0
    # The user's code: a task (module:function and its JSON arguments, canonical text) or a
    # script of their own loop with its arguments.
    task: str = DEFAULT_TASK
    task_args: str = "{}"
    script: str | None = None
    script_args: tuple[str, ...] = ()
    # Where the user's modules are: put first on sys.path after the trainer's own packages are
    # imported, so a user's top-level `trainer/` or `hybridtrain/` cannot replace them.
    code_dir: str | None = None
    data_workers: int | None = None
    # The exchange's defaults here are the trainer's own: a run's options (flags, --options-json)
    # take their strategy's first, the paper benchmark's configuration (hybridtrain.strategy_defaults:
    # a 4-chunk pipeline, density 0.05 in [0.02, 0.1], server k 1/8, one warm-up step, ...).
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
    # DGC's momentum correction: compressing strategies with an SGD optimizer accumulate momentum
    # on the workers, before compression, instead of applying it to the sparse update (trainer.ps).
    momentum_correction: bool = True
    warmup_steps: int = 5
    # PS strategies: the compressed part travels in this many chunks, pipelined (trainer.ps).
    pipeline_chunks: int = 1
    # PS strategies with --sites: a remote site's workers send their gradients to the site's
    # relay, which combines them and sends one frame across the WAN (trainer.ps).
    site_aggregation: bool = False
    # PS strategies: step t's update is applied at step t+1's step(), after step t+1's gradient
    # (computed without it) has left, so the server's work and the reply's way back hide behind
    # the next step's compute; gradients are one step stale (trainer.ps.PSClient.drain).
    # PS strategies: a worker's step() applies the update's first chunk (the dense part and the
    # next step's batch split ride with it) and returns; each later chunk is applied by a
    # forward pre-hook just before the first module holding its parameters runs, so the rest
    # of the reply's way back hides behind the next forward pass with nothing stale
    # (trainer.ps.PSClient).
    apply_in_forward: bool = False
    dense_numel: int = 1024
    eval_every: int = 50
    checkpoint_every: int = 0
    # Also checkpoint when this many seconds have passed since the last one (0: by steps only).
    checkpoint_every_s: float = 0.0
    checkpoint_dir: str = "checkpoints"
    # Where checkpoints are uploaded to and, with --resume, the latest one is read from:
    # the control plane's store for the run (PUT ?step=N, GET the latest), with report_token.
    checkpoint_url: str | None = None
    resume: bool = False
    # PS strategies: below this many live workers the server pauses and waits for joiners for
    # min_workers_wait_s, then fails the run with the reason.
    min_workers: int = 1
    min_workers_wait_s: float = 300.0
    # PS strategies: how long a run waits for every expected worker before it starts with
    # those there (at least min_workers); the rest join later (trainer.joiner).
    start_wait_s: float = 120.0
    # PS strategies: the worker ranks the start waits for (empty: every rank 1..workers). A
    # restart names the ranks it launched, so a resumed run with gaps in its ranks (a node lost
    # for good) waits for those only, and for as long as a fresh run.
    expect_ranks: tuple[int, ...] = ()
    # A worker started into a running run: the server admits it at the next step boundary and
    # hands it the current model and a share of the batch.
    join: bool = False
    metrics_out: str | None = None
    report_url: str | None = None
    report_token: str | None = None
    # Where records the control plane could not take before exit are written (JSON lines, with
    # their stream and sequence numbers), for the agent to deliver later.
    report_spool: str | None = None
    # PS strategies: the run's shared secret; with it every connection between its ranks is
    # mutual TLS (trainer.linktls), without it plain TCP that admits any process that connects.
    link_secret: str | None = field(default=None, repr=False)
    threads: int = 1
    device: str = "cpu"
    # bf16 autocast around the task's forward pass and loss.
    amp: bool = False
    timeout_s: float = 300.0
    log_every: int = 0
    link_mbps: tuple[float, ...] = ()
    # Site label per rank (0 the server): the server's update crosses to each remote site once.
    sites: tuple[str, ...] = ()
    emulate_speeds: bool = False
    powersgd_rank: int = 2
    powersgd_start: int = 10
    # Local SGD (`diloco`, `diloco-gc`): inner steps between outer steps (H), and the outer
    # optimizer, Nesterov SGD on the averaged parameter change (trainer.local_sgd).
    sync_every: int = DEFAULT_SYNC_EVERY
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    # diloco-gc: the pseudo-gradient's top-k density, from which its bounds and the server's k
    # follow (hybridtrain.contract.outer_density_plan); the --density flags are the PS strategies'.
    outer_density: float = DEFAULT_OUTER_DENSITY
    # Local SGD: apply each outer step this many inner steps after its change was sent, so the
    # exchange overlaps them (0: wait for it; below sync_every). trainer.local_sgd. A run's
    # options default to 3 (hybridtrain.strategy_defaults, through trainer.run_options.option_fields).
    outer_delay: int = 0
    # Local SGD: apply each outer step at the first inner step boundary after its mean change has
    # arrived, instead of outer_delay steps later; wait for it only once it is max_staleness inner
    # steps old (None: sync_every - 1). trainer.outer_steps.OuterSteps.
    asynchronous: bool = False
    max_staleness: int | None = None
    # Local SGD with --sites: each site's workers are one replica, averaging their gradients every
    # inner step through the site's relay; one change per site crosses at each outer step
    # (trainer.site_replica).
    site_replicas: bool = False
    # Local SGD, streaming (Streaming DiLoCo): the exchange's chunks are this many fragments of the
    # model, each with its outer step every sync_every steps, staggered (hybridtrain.contract.
    # sync_fragments); 1: off, the whole model at once in --pipeline-chunks chunks.
    fragments: int = 1

    @property
    def is_ps(self) -> bool:
        """Whether rank 0 is a parameter server."""
        return self.strategy in PS_STRATEGIES

    @property
    def is_local_sgd(self) -> bool:
        """Whether workers take inner steps locally between outer steps (`diloco`, `diloco-gc`)."""
        return is_local_sgd(self.strategy)

    @property
    def staleness_bound(self) -> int:
        """The inner steps after its change was sent at which a worker waits for an outer step:
        the asynchronous bound, or the fixed --outer-delay (0: at once)."""
        if self.asynchronous:
            return self.max_staleness or self.sync_every - 1
        return self.outer_delay

    @property
    def defers_late_changes(self) -> bool:
        """Whether the server closes an outer round without its stragglers and folds their changes
        into a later one (trainer.late_changes): asynchronous outer steps of the whole model, not
        streaming's fragments (whose rounds keep waiting for every worker)."""
        return self.asynchronous and self.is_local_sgd and not self.streams and not self.combines_at_sites

    @property
    def densities(self) -> tuple[float, float, float, float]:
        """The compressed exchange's (target density, lowest, highest, server k): the --density
        flags, or diloco-gc's from --outer-density."""
        if self.is_local_sgd:
            return outer_density_plan(self.outer_density)
        return self.density, self.density_min, self.density_max, self.server_k_fraction

    @property
    def compresses(self) -> bool:
        """Whether gradients are sparsified (`ps-gc`, `ps-bz-gc` unless --compressor none)."""
        return compresses(self.strategy, self.compressor)

    @property
    def combines_at_sites(self) -> bool:
        """Whether a site's relay sends the server one frame for its site: per-site aggregation's
        gradients, or the site replicas' outer steps."""
        return self.site_aggregation or self.site_replicas

    @property
    def applies_in_forward(self) -> bool:
        """Whether the update's chunks after the first are applied during the next forward pass:
        asked for, under a compressing PS strategy with momentum correction and several chunks,
        and not under per-site aggregation (whose updates come through the site's relay)."""
        return (self.apply_in_forward and self.is_ps and not self.is_local_sgd and self.compresses
                and self.momentum_correction
                and self.pipeline_chunks > 1
                and not self.site_aggregation)

    @property
    def streams(self) -> bool:
        """Whether local SGD's outer steps go fragment by fragment (streaming, --fragments > 1)."""
        return self.is_local_sgd and self.fragments > 1

    @property
    def exchange_chunks(self) -> int:
        """The chunks asked for an exchange: one per fragment when streaming, else --pipeline-chunks."""
        return self.fragments if self.streams else self.pipeline_chunks

    def round_chunks(self, step: int, chunks: int, max_steps: int) -> tuple[int, ...]:
        """The chunks (of `chunks`) the exchange after `step` carries: all of them, or when
        streaming those of the fragments whose outer step follows `step` (chunk p is fragment p)."""
        if not self.streams:
            return tuple(range(chunks))
        return sync_fragments(step, self.sync_every, max_steps, chunks)

    @property
    def world_size(self) -> int:
        """Processes in the run: the workers, plus the server for PS strategies."""
        return self.workers + (1 if self.is_ps else 0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (for checkpoints, logs and the launch environment)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """The inverse of `to_dict`, ignoring unknown keys from newer versions."""
        names = {f.name for f in fields(cls)}
        clean = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in names}
        return cls(**clean)


def initial_batch_sizes(cfg: TrainConfig) -> list[int]:
    """Step 1: explicit --batch-sizes win; else equal, or proportional to --speeds."""
    if cfg.batch_sizes:
        return list(cfg.batch_sizes)
    if cfg.allocation in ("flops", "measured") and cfg.speeds:
        return proportional_batch_sizes(cfg.global_batch, cfg.speeds)
    return equal_batch_sizes(cfg.global_batch, cfg.workers)
