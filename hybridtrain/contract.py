"""Names and arithmetic shared by the control plane, the agent and the trainer.

Standard library only: the control plane (no torch), the agent (no torch in its own process)
and the trainer all import this one module, so a strategy, a metric name, a flag of the launch
contract or the batch split exists once (conventions: names shared across processes live once).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

# -- strategies and their knobs ---------------------------------------------------------------

ALLREDUCE, ALLREDUCE_POWERSGD, PS, PS_GC, PS_BZ_GC = (
    "allreduce", "allreduce-powersgd", "ps", "ps-gc", "ps-bz-gc")
# Local SGD (DiLoCo, Douillard et al. 2023): H inner steps of the task's own optimizer on each
# worker, then one outer step on the samples-weighted mean of the workers' parameter changes;
# `diloco-gc` sends those changes through the top-k codec with error feedback (SparseLoCo).
DILOCO, DILOCO_GC = "diloco", "diloco-gc"
STRATEGIES = (ALLREDUCE, ALLREDUCE_POWERSGD, PS, PS_GC, PS_BZ_GC, DILOCO, DILOCO_GC)
# The strategies with a server at rank 0 (its own transport, elastic membership, checkpoints).
PS_STRATEGIES = (PS, PS_GC, PS_BZ_GC, DILOCO, DILOCO_GC)
LOCAL_SGD_STRATEGIES = (DILOCO, DILOCO_GC)
# The strategies that sparsify what they send (unless their compressor is "none").
COMPRESSING_STRATEGIES = (PS_GC, PS_BZ_GC, DILOCO_GC)
DEFAULT_STRATEGY = PS_BZ_GC
# How reports and pages name them (the paper's spelling).
STRATEGY_LABELS = {ALLREDUCE: "All-Reduce", ALLREDUCE_POWERSGD: "All-Reduce + PowerSGD", PS: "PS",
                   PS_GC: "PS-gc", PS_BZ_GC: "PS-bz-gc", DILOCO: "DiLoCo", DILOCO_GC: "DiLoCo-gc"}
# Local SGD's defaults: the inner steps between outer steps (H), and the outer optimizer (Nesterov
# SGD). H is far below DiLoCo's 500 because the runs this project trains last hundreds of steps,
# not tens of thousands. The outer step defaults to plain averaging (rate 1, no momentum), not
# DiLoCo's published 0.7 and 0.9: on this project's short runs from scratch those diverged on
# widecnn and ended the character model 0.08 nats worse than averaging (docs/trainer.md).
DEFAULT_SYNC_EVERY = 20
DEFAULT_OUTER_LR = 1.0
DEFAULT_OUTER_MOMENTUM = 0.0
# diloco-gc's top-k density: a change of H steps is denser than one gradient, and 1 % (the PS
# strategies' default then) left the character model 0.43 nats above allreduce after 300 steps.
DEFAULT_OUTER_DENSITY = 0.1
# What each strategy gets for an option a run leaves unset (these, the outer delay, the paper
# benchmark's pipeline, compression and re-split): hybridtrain.strategy_defaults.


def outer_density_plan(density: float) -> tuple[float, float, float, float]:
    """diloco-gc's (target, lowest, highest, server k) densities from its one knob: the adaptive
    rule moves each worker's within [d/2, 2d], and the server keeps 2.5 d of the mean change
    (the union of the workers' top-k is denser than any one of them)."""
    return density, density / 2, min(1.0, 2 * density), min(1.0, 2.5 * density)
ALLOCATIONS = ("equal", "flops", "measured")
COMPRESSORS = ("none", "topk", "randomk")
VALUE_DTYPES = ("fp32", "fp16", "fp8")
# Bytes a compressed value takes on the wire (fp8 values share one 4-byte scale a payload).
VALUE_BYTES = {"fp32": 4, "fp16": 2, "fp8": 1}
SELECT_METHODS = ("estimate", "threshold", "topk", "sort")
DEVICES = ("cpu", "cuda", "auto")


def is_ps(strategy: str) -> bool:
    """Whether `strategy` runs a parameter server as rank 0."""
    return strategy in PS_STRATEGIES


def is_local_sgd(strategy: str) -> bool:
    """Whether `strategy` takes inner steps locally between outer steps (the DiLoCo family)."""
    return strategy in LOCAL_SGD_STRATEGIES


def compresses(strategy: str, compressor: str = "topk") -> bool:
    """Whether `strategy` sparsifies gradients with `compressor`."""
    return strategy in COMPRESSING_STRATEGIES and compressor != "none"


def default_allocation(strategy: str) -> str:
    """`ps-bz-gc` sizes batches by speed (its point); local SGD starts from that split and
    re-splits it from the compute times measured over every round of inner steps, so that its
    workers reach each outer step together; every baseline splits equally."""
    if strategy in LOCAL_SGD_STRATEGIES:
        return "measured"
    return "flops" if strategy == PS_BZ_GC else "equal"


def sync_due(step: int, every: int, max_steps: int, fragments: int = 1) -> bool:
    """Whether local SGD's outer step (of some fragment) follows inner step `step`: every `every`
    steps counted from step 0, and at the run's last step, so that a run ends on the common model."""
    return bool(sync_fragments(step, every, max_steps, fragments))


def next_sync(step: int, every: int, max_steps: int, fragments: int = 1) -> int:
    """The first step after `step` that an outer step (of some fragment) follows."""
    ahead = min(step + (offset - step - 1) % every + 1 for offset in fragment_offsets(every, fragments))
    return min(ahead, max(max_steps, step + 1))


# Streaming DiLoCo (Douillard et al. 2025): the model's P fragments each take their outer step
# every H steps, fragment p after the steps (p + 1) * H // P + k H, so the exchanges are spread
# over the H steps and each carries 1/P of the model. P = 1 is plain DiLoCo (every H-th step).
MAX_FRAGMENTS = 16


def fragment_offsets(every: int, fragments: int = 1) -> tuple[int, ...]:
    """The step (mod `every`, as 1..every) after which each fragment takes its outer step; P <= H
    keeps them distinct, so at most one fragment syncs a step until the run's last."""
    if not 1 <= fragments <= every:
        raise ValueError(f"{fragments} fragments with sync_every {every}: need 1 <= fragments <= sync_every")
    return tuple((p + 1) * every // fragments for p in range(fragments))


def sync_fragments(step: int, every: int, max_steps: int, fragments: int = 1) -> tuple[int, ...]:
    """The fragments whose outer step follows inner step `step` (none, one, or at the run's last
    step all of them, so that the run ends on the common model)."""
    if step >= max_steps:
        return tuple(range(fragments))
    return tuple(p for p, offset in enumerate(fragment_offsets(every, fragments)) if (step - offset) % every == 0)


# -- the batch split (seed 000, section III-A) ------------------------------------------------


def proportional_batch_sizes(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """Step 1: split `global_batch` in proportion to `speeds`; sums exactly to B, each >= 1.

    Largest-remainder rounding after reserving one sample per worker, so the rounding error of
    any share is below one sample and ties break towards the lower worker index (the same
    answer on every rank and in the control plane's planner).
    """
    m = len(speeds)
    if m == 0:
        raise ValueError("speeds: at least one worker is required")
    if any(not (s > 0) or not math.isfinite(s) for s in speeds):
        raise ValueError(f"speeds: every speed must be a finite number > 0, got {list(speeds)}")
    if global_batch < m:
        raise ValueError(f"global batch {global_batch} is smaller than the {m} workers")
    total = float(sum(speeds))
    # Reserve the guaranteed sample first so a very slow worker still gets n_m >= 1 without
    # taking more than its share from the others.
    spare = global_batch - m
    exact = [spare * s / total for s in speeds]
    sizes = [int(e) for e in exact]
    left = spare - sum(sizes)
    order = sorted(range(m), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    return [n + 1 for n in sizes]


def equal_batch_sizes(global_batch: int, workers: int) -> list[int]:
    """Equal shares of `global_batch` (the first `B mod M` workers get one more)."""
    return proportional_batch_sizes(global_batch, [1.0] * workers)


def aggregation_weights(batch_sizes: Sequence[int]) -> list[float]:
    """alpha_m = n_m / sum(n) (eq. 1)."""
    total = sum(batch_sizes)
    if total <= 0:
        raise ValueError(f"batch sizes must sum to a positive number, got {list(batch_sizes)}")
    return [n / total for n in batch_sizes]


# -- the adaptive density rule (step 5) ----------------------------------------------------------


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
    """Step 5, the per-worker density rule: d_m <- d_m * (mean(T) / T_m)^gamma, renormalised.

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


def steps_for_epochs(epochs: float, train_samples: int, global_batch: int) -> int:
    """Steps that pass over `train_samples` `epochs` times at `global_batch` (the trainer
    treats its shuffled epochs as one stream, so a partial last batch carries into the next)."""
    if train_samples <= 0 or global_batch <= 0 or epochs <= 0:
        raise ValueError("epochs, train samples and global batch must all be positive")
    return max(1, math.ceil(epochs * train_samples / global_batch))


# -- metrics ----------------------------------------------------------------------------------

# What the trainer itself measures. A task adds its own evaluation metrics under their own
# names (`accuracy`, `val_loss`, `r2`, ...); `val_loss`, the task's loss on its evaluation
# data, is reported for every task that has evaluation data.
SYSTEM_METRICS = frozenset(
    {"loss", "batch_size", "samples_per_s", "compute_s", "data_s", "compress_s", "comm_s", "wait_s",
     "bytes_sent", "bytes_recv", "density", "time_to_target_s", "max_steps", "params", "eval_s",
     # Local SGD's outer steps: the norm of the averaged parameter change each one applied, and
     # the inner steps a worker took between sending its change and applying that outer step;
     # asynchronous, the server's count per outer step of the workers it went on without, the
     # late changes it folded in, and those it dropped as too late (trainer.late_changes).
     "outer_norm", "outer_staleness", "outer_deferred", "outer_folded", "outer_dropped",
     # Data sets (hybridtrain.datasets): bytes fetched from the store and from the site cache,
     # and the samples the loader read with their digest, with the data set's id as the peer.
     "data_bytes", "data_cache_bytes", "data_samples", "data_sample_digest"}
)
# Seconds an evaluation held the run up (logged at its step). time_to_target_s counts them, as
# the bill does; a comparison of training algorithms subtracts them (bench/paper/paper_figures.py).
EVAL_S = "eval_s"
VAL_LOSS = "val_loss"
# The metric name of runs stored before task metrics existed (read, never written).
LEGACY_TIME_TO_TARGET = "time_to_accuracy_s"
METRIC_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


# Run events: membership and recovery, reported by the trainer in its metrics stream as records
# with an "event" key instead of "name"/"value" (trainer.metrics.MetricsLogger.event). `subject`
# is the rank the event is about; the control plane stores them as the run's timeline.
EVENT_WORKER_JOINED = "worker_joined"  # admitted at a step boundary (a new node or a restart)
EVENT_WORKER_LEFT = "worker_left"  # left cleanly (a spot notice, a SIGTERM)
EVENT_WORKER_LOST = "worker_lost"  # silent or disconnected: dropped, its residual is gone
EVENT_WAITING = "waiting_for_workers"  # fewer than min_workers: training paused
EVENT_RESUMED = "resumed"  # restarted from a checkpoint
EVENT_CHECKPOINT = "checkpoint"  # a checkpoint was written (and uploaded)
EVENT_KINDS = frozenset(
    {EVENT_WORKER_JOINED, EVENT_WORKER_LEFT, EVENT_WORKER_LOST, EVENT_WAITING, EVENT_RESUMED,
     EVENT_CHECKPOINT}
)


# Why an agent stopped a role, sent as the exit event's "cause": the control plane tells a
# cancel order from a spot notice (a worker leaving cleanly) and from roles lost with their agent.
CAUSE_CANCEL = "cancel"
CAUSE_AGENT_STOPPING = "agent_stopping"
CAUSE_AGENT_RESTARTED = "agent_restarted"
STOP_CAUSES = (CAUSE_CANCEL, CAUSE_AGENT_STOPPING, CAUSE_AGENT_RESTARTED)


def check_metric_name(name: str) -> str:
    """`name` if a task may report a metric under it; ValueError saying why not otherwise."""
    if not METRIC_NAME.match(name):
        raise ValueError(f"metric name {name!r}: use 1-32 of a-z, 0-9 and _, starting with a letter")
    if name in SYSTEM_METRICS:
        raise ValueError(f"metric name {name!r} is one the trainer reports itself")
    return name


@dataclass(frozen=True)
class Target:
    """A stopping or reporting target: `metric` reaching `value` from the `op` side."""

    metric: str
    op: str  # ">=" or "<="
    value: float

    def reached(self, measured: float) -> bool:
        """Whether `measured` meets the target (NaN never does)."""
        if not math.isfinite(measured):
            return False
        return measured >= self.value if self.op == ">=" else measured <= self.value

    @property
    def higher_is_better(self) -> bool:
        return self.op == ">="

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


_TARGET = re.compile(r"^\s*([a-z][a-z0-9_]{0,31})\s*(>=|<=)\s*([-+0-9.eE]+)\s*$")


def parse_target(text: str) -> Target:
    """'accuracy>=0.9' or 'val_loss <= 0.3' as a Target; ValueError naming what is wrong."""
    m = _TARGET.match(text)
    if m is None:
        raise ValueError(f"target {text!r}: expected METRIC>=VALUE or METRIC<=VALUE, e.g. accuracy>=0.9")
    try:
        value = float(m.group(3))
    except ValueError:
        raise ValueError(f"target {text!r}: {m.group(3)!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"target {text!r}: the value must be finite")
    if m.group(1) in SYSTEM_METRICS:
        raise ValueError(f"target {text!r}: {m.group(1)} is not an evaluation metric")
    return Target(m.group(1), m.group(2), value)


# -- tasks --------------------------------------------------------------------------------------

_TASK_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_TASK = "hybridtrain.tasks.digits:smallcnn"


def check_task_ref(ref: str) -> str:
    """`ref` if it has the form package.module:function; ValueError otherwise."""
    if not _TASK_REF.match(ref or ""):
        raise ValueError(f"task {ref!r}: expected module:function, e.g. examples.diabetes:task")
    return ref


# -- the launch contract ------------------------------------------------------------------------

# Environment through which a launcher (`hybridtrain launch`, the agent) tells a user's own
# training script which role it plays; `hybridtrain.init()` reads it. The script names no
# rank, port or address itself, as under torchrun.
ENV_ROLE = "HYBRIDTRAIN_ROLE"
ENV_RANK = "HYBRIDTRAIN_RANK"
ENV_WORLD_SIZE = "HYBRIDTRAIN_WORLD_SIZE"
ENV_MASTER_ADDR = "HYBRIDTRAIN_MASTER_ADDR"
ENV_MASTER_PORT = "HYBRIDTRAIN_MASTER_PORT"
# The run's configuration (the trainer's TrainConfig) as JSON.
ENV_CONFIG = "HYBRIDTRAIN_CONFIG"
LAUNCH_ENV = (ENV_ROLE, ENV_RANK, ENV_WORLD_SIZE, ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_CONFIG)

# Trainer flags a launch order sets through its own fields, never through `options`.
RESERVED_FLAGS = frozenset(
    {"role", "rank", "world-size", "master-addr", "master-port", "batch-sizes", "report-url",
     "report-token", "report-token-file", "report-spool", "checkpoint-url", "join", "options-json"}
)
# The exit status of a PS server that gave up waiting for --min-workers workers (after
# --min-workers-wait-s): the control plane fails the run instead of restarting it.
EXIT_TOO_FEW_WORKERS = 3
# A bundle of the user's code: a gzipped tar, named by the sha256 of its bytes.
BUNDLE_MEDIA_TYPE = "application/gzip"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The Celery task that asks an agent to profile a task on its node (control plane -> agent).
PROFILE_TASK = "hybridtrain.profile_task"
# The Celery task that asks an agent to measure its links to other nodes' probe servers
# (control plane -> agent); args [spec], spec = {"targets": [{"node_id", "host", "port"}],
# "seconds": float}.
PROBE_LINKS_TASK = "hybridtrain.probe_links"
