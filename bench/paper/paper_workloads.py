"""The paper benchmark's workloads (widecnn and ResNet-18 on digits), their quick variants,
the testbeds a full run covers, the strategies' variants, and how command-line flags pick and
override them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybridtrain.contract import (COMPRESSING_STRATEGIES, DEFAULT_SYNC_EVERY, DILOCO_GC, LOCAL_SGD_STRATEGIES,
                                  PS_STRATEGIES)
from testbed.errors import TestbedError


@dataclass(frozen=True)
class BenchSettings:
    """One benchmark's hyperparameters: the same for every strategy."""

    # A task reference (module:function) and its JSON args; the built-in tasks take lr,
    # momentum, weight_decay, schedule and warmup_steps.
    task: str
    global_batch: int
    max_steps: int
    # What time to target measures, e.g. "accuracy>=0.95" (hybridtrain.contract.parse_target).
    target: str
    task_args: dict[str, Any] = field(default_factory=dict)
    # A task of the user's own code: this directory (relative to the repository) is packed and
    # uploaded as the runs' bundle, as `runs create --workdir` does, and the standalone
    # measurement imports from it.
    workdir: str | None = None
    seed: int = 0
    # Each strategy runs with seeds seed, seed + 1, ...: the results are means over them, with
    # their spread (the testbed's figures move a few percent from run to run).
    seeds: int = 1
    # Applied to ps-gc and ps-bz-gc (and powersgd_rank to allreduce-powersgd); what it leaves
    # unset is the strategy's default (hybridtrain.strategy_defaults).
    compression: dict[str, Any] = field(default_factory=dict)
    powersgd_rank: int | None = None
    # Applied to diloco and diloco-gc: sync_every, outer_lr, outer_momentum, outer_density.
    local_sgd: dict[str, Any] = field(default_factory=dict)
    # ps-bz-gc re-splits its batch from observed compute times every N steps (None: its default).
    rebalance_every: int | None = None
    # Evaluate every N steps (None: the trainer's default); time to accuracy is only as fine as this.
    eval_every: int | None = None
    # False: every run records when it reaches the target and trains on to max_steps, so final
    # accuracies compare at the same step budget, not at whichever evaluation crossed the target.
    stop_at_target: bool = True
    # PS strategies (all of them, so the baselines get it too): the step pipelined in this many
    # chunks (None: the default).
    pipeline_chunks: int | None = None
    # Seconds of compute in a balanced step: when set, the global batch is re-chosen from the
    # measured ideal so that a step computes this long on whatever host runs the benchmark
    # (`global_batch` is then the probe the ideal is first measured on). None: as given.
    balanced_step_s: float | None = None
    # The calibration never goes below this: on a slow model or host the step then computes
    # longer than balanced_step_s (less communication-bound) rather than training on batches
    # too small to learn from (32 over four workers left a shapes run at chance).
    min_global_batch: int = 128
    max_global_batch: int = 1024
    # Steps at the start of each run left out of the steady-state throughput: the compressed
    # strategies send dense gradients in their warm-up steps, PowerSGD starts compressing at
    # step 10 (the trainer's --powersgd-start, which the API does not expose).
    skip_steps: int = 10
    standalone_seconds: float = 12.0
    run_timeout_s: float = 900.0


# Why these: docs/testbed.md, "Choosing the workload". The exchange's settings chosen on this
# workload are the strategies' defaults (hybridtrain.strategy_defaults, which says why each) and
# are left unset here, so that the benchmark runs what a user launching with the defaults gets;
# a test keeps them unset. A dense gradient of the model takes
# 2.1 s per direction over the 100 Mbit/s WAN (both cloud workers share it; a `ps` step moves
# 3.5 s of gradients and updates across it) against 1.5 s of compute in a balanced step, on any
# host: the batch is calibrated to that compute time from the measured ideal (328 on the host
# of 2026-11-23 18:20, 240 the probe it is measured on first).
FULL = BenchSettings(
    task="hybridtrain.tasks.digits:widecnn",
    # The built-in tasks' other defaults (momentum 0.9, weight decay 5e-4, cosine schedule
    # after 10 warm-up steps) are the trainer's former ones, so results stay comparable.
    # 60 % of digits held out: 1,078 images, so one is 0.09 points of accuracy (at the default
    # 20 %, 360 images, one was 0.28). Trained alone on the other 719 at batch 328 the model
    # crosses 0.95 at step 30 and ends at 0.973.
    task_args={"lr": 0.1, "holdout": 0.6},
    global_batch=240,
    max_steps=50,
    target="accuracy>=0.95",
    # Time to target is read this finely; the evaluations' own time is left out of it
    # (bench/paper/paper_figures.py), and of the throughput.
    eval_every=2,
    stop_at_target=False,
    balanced_step_s=1.5,
    # Five outer steps in 50: H = 5 and 10 both end within 0.2 points of ps-bz-gc's accuracy
    # trained alone (0.980, 0.978 against 0.981), H = 20 (the default, for runs of hundreds of
    # steps) leaves too few outer steps. The outer delay is the default, 0.
    local_sgd={"sync_every": 10},
    seeds=3,
)  # fmt: skip

# The second workload: ResNet-18 (11.2M parameters, 44.7 MB of dense gradient, 3.3x widecnn's)
# at digits' reduced 8x8 input, where it computes about as fast per sample as widecnn (600
# samples/s on one core here): a dense `ps` step moves 10 s over the WAN against the same
# 1.5 s of balanced compute, far more communication-bound than widecnn. Trained alone at batch
# 256 with lr 0.05 it crosses 0.93 at step 30 (0.95 at 35). Sparser than widecnn's: at 5 %
# the compressed gradients and the server's update would still take 1.6 s a step on the WAN.
RESNET18 = replace(
    FULL,
    task="hybridtrain.tasks.digits:resnet18",
    task_args={"lr": 0.05, "holdout": 0.6},
    max_steps=40,
    target="accuracy>=0.93",
    compression={"density": 0.02, "density_min": 0.01, "density_max": 0.05, "server_k_fraction": 0.0625},
    balanced_step_s=2.5,
    max_global_batch=2048,
)  # fmt: skip
# The third: a transformer with AdamW, what most users train across sites, as a user's own code
# (examples/charlm, uploaded as a bundle): 279k parameters, so its dense exchange is small, and
# what separates the strategies is how many steps each needs to the target. Trained alone on
# this host at batch 64 allreduce reaches val_loss 0.9 by step 120, diloco (H 20) by 140,
# ps-bz-gc by about 450 (docs/trainer.md).
CHARLM = replace(
    FULL,
    task="charlm:task",
    workdir="examples/charlm",
    task_args={},
    global_batch=64,
    max_steps=300,
    target="val_loss<=0.9",
    eval_every=20,
    balanced_step_s=None,
    # A 1.1 MB gradient needs no pipeline; the compression is the default (its figures in
    # docs/BENCHMARKS.md are from before the defaults were widecnn's: top-k at 1 %, no re-split).
    pipeline_chunks=1,
    local_sgd={"sync_every": 20},
    skip_steps=10,
    seeds=1,
    run_timeout_s=3600.0,
)  # fmt: skip
# `hybridtrain bench paper --workloads`: each runs every strategy on every testbed of --config.
WORKLOADS = {"widecnn": FULL, "resnet18": RESNET18, "charlm": CHARLM}


def quick(full: BenchSettings) -> BenchSettings:
    """A workload's smoke test of the whole path rather than a measurement: each run spends
    about 34 s starting and stopping (importing torch and the trainer is 3.4 s of CPU, 22 s on
    a V100 node's 0.157 core), which leaves four steps of half the probe batch per strategy,
    one of them dense for the compressed ones, one seed, and a target the single evaluation
    (the last step) passes."""
    return BenchSettings(
        task=full.task, task_args=full.task_args, workdir=full.workdir, global_batch=full.global_batch // 2,
        max_steps=4,
        target="accuracy>=0.2", compression=full.compression, pipeline_chunks=full.pipeline_chunks,
        # An outer step every 2 steps; the default overlap follows H (1 here).
        local_sgd=full.local_sgd | {"sync_every": 2},
        skip_steps=1, standalone_seconds=2.0, run_timeout_s=180.0,
    )


QUICK = quick(FULL)


def workdir_of(s: BenchSettings) -> Path | None:
    """The workload's own code directory, resolved against the repository (None: built-in task)."""
    return Path(__file__).resolve().parents[2] / s.workdir if s.workdir else None


def seeds_of(s: BenchSettings) -> list[int]:
    """The seeds each strategy runs with."""
    return [s.seed + i for i in range(max(1, s.seeds))]


def with_overrides(settings: BenchSettings, args: argparse.Namespace) -> BenchSettings:
    """`settings` with the workload flags that were given on the command line (a batch given
    there is used as it is, not calibrated)."""
    names = ("task", "task_args", "global_batch", "max_steps", "target", "pipeline_chunks",
             "balanced_step_s", "seeds")
    changes: dict[str, Any] = {name: getattr(args, name) for name in names
                               if getattr(args, name, None) is not None}  # fmt: skip
    if "global_batch" in changes:
        changes["balanced_step_s"] = None
    if getattr(args, "server_k_fraction", None) is not None:
        changes["compression"] = settings.compression | {"server_k_fraction": args.server_k_fraction}
    return replace(settings, **changes)


def calibrated_batch(ideal_samples_per_s: float, step_s: float, workers: int, multiple: int = 8,
                     largest: int = 1024, smallest: int = 0) -> int:
    """The global batch, a multiple of `multiple`, whose balanced compute takes `step_s` at the
    measured ideal speed; at least `smallest` and `multiple` samples per worker, at most `largest`."""
    if ideal_samples_per_s <= 0 or step_s <= 0:
        raise ValueError(f"need a positive speed and step time, got {ideal_samples_per_s} and {step_s}")
    batch = round(ideal_samples_per_s * step_s / multiple) * multiple
    return max(multiple * workers, smallest, min(largest, batch))


def calibrate(standalone: dict[str, float], balanced_step_s: float, probe_batch: int, workers: int, *,
              smallest: int, largest: int) -> tuple[dict[str, Any], list[str]]:
    """The global batch whose balanced compute takes `balanced_step_s` at the standalone rates
    measured at `probe_batch`, as the results' calibration record, and the lines to log."""
    probe = round(sum(standalone.values()), 2)
    batch = calibrated_batch(probe, balanced_step_s, workers, smallest=smallest, largest=largest)
    lines = []
    if batch == smallest and probe * balanced_step_s < batch:
        lines.append(f"  calibration: {probe} samples/s would give a batch under {smallest}; "
                     f"a step computes about {batch / probe:.1f} s instead of {balanced_step_s} s")
    lines.append(f"  calibrated: {probe} samples/s at batch {probe_batch} -> global batch {batch} "
                 f"for {balanced_step_s} s of compute a step")
    record = {"probe_batch": probe_batch, "probe_ideal_samples_per_s": probe, "balanced_step_s": balanced_step_s,
              "global_batch": batch}
    return record, lines


# The testbeds of a full run: seed 000's and seed 003's intercontinental one; --quick runs the first.
CONFIGS = ("bench/testbeds/paper.yaml", "bench/testbeds/intercontinental.yaml")


def workloads_of(args: argparse.Namespace) -> list[tuple[str, BenchSettings]]:
    """(name, settings) of each workload to run, command-line overrides applied to each:
    all of WORKLOADS for a full run, the first for --quick, or those --workloads names."""
    names = args.workloads.split(",") if getattr(args, "workloads", None) else (
        list(WORKLOADS)[:1] if args.quick else list(WORKLOADS))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise TestbedError(f"--workloads: unknown workload {', '.join(unknown) or '(none)'} "
                           f"(one or more of {', '.join(WORKLOADS)})")
    return [(n, with_overrides(quick(WORKLOADS[n]) if args.quick else WORKLOADS[n], args)) for n in names]


def configs_of(args: argparse.Namespace) -> list[str]:
    """The testbed configs to run on, in order: --config's comma-separated list, else CONFIGS
    (the first of them for --quick)."""
    if getattr(args, "config", None):
        return [c for c in str(args.config).split(",") if c]
    return list(CONFIGS[:1] if args.quick else CONFIGS)


# A strategy's variants, measured side by side with it: `+plain`, its links unencrypted (what
# TLS costs; runs encrypt by default); `+sites`, a PS strategy with each remote site's gradients
# combined at its relay (`compression.aggregate_at_sites`, what per-site aggregation gains);
# `+fp8`, a compressing PS strategy whose values travel as fp8 (`compression.value_dtype`);
# `+fp32`, a local SGD or compressing strategy whose values travel as fp32 (under sites as
# replicas the in-site exchange too, which is bf16 otherwise);
# `+inforward`, a PS strategy applying its update's later chunks during the next forward pass
# (`compression.apply_in_forward`); `+quotaio`, any strategy with each node's communication
# threads left on its GPU quota (the testbed's thread placer paused for the run: the emulation
# before 2026-12-01, testbed/thread_placer.py); `+chunksN`, a PS strategy with its step
# pipelined in N chunks instead of the workload's (the default 4); `+delayN`, a local SGD strategy
# applying each outer step N inner steps after its exchange began (`local_sgd.outer_delay`;
# `+delay3` overlaps 3, against the default of 0); `+replicas`, a local SGD strategy whose
# sites are its replicas, each site's workers averaging every inner step over their LAN and one
# change per site crossing the WAN (`local_sgd.site_replicas`); `+async`, a local SGD strategy
# applying each outer step as soon as it has arrived instead of a fixed delay later
# (`local_sgd.asynchronous`, bounded by its default max_staleness, H - 1); `+streaming`, a local
# SGD strategy whose outer steps go in STREAMING_FRAGMENTS staggered fragments (at most H of them),
# each exchange 1/P of the model (`local_sgd.fragments`, Streaming DiLoCo); `+hN`, a local SGD
# strategy taking N inner steps between outer steps instead of the workload's H (`local_sgd.sync_every`:
# the WAN bytes a sample fall as 1/H, the measure of issue 49's 100x and 1000x); `+densityN`,
# `diloco-gc` with its outer density at N % instead of 10 % (`local_sgd.outer_density`; the
# server keeps 2.5 times it); `+olrN`, a local SGD strategy whose outer learning rate is N / 100
# instead of its default 1 (`local_sgd.outer_lr`: `+olr150` moves the model 1.5 times the mean
# change, past the average); `+momN`, a local SGD strategy whose outer Nesterov momentum is
# N / 100 instead of its default 0 (`local_sgd.outer_momentum`). Variants chain, applied in
# order: `diloco-gc+h100+density5`.
# (`+overlap`, a PS strategy sending its chunks during the backward pass, went with the option:
# it never paid, docs/CHANGELOG.md.)
VARIANTS = ("plain", "sites", "fp8", "fp32", "inforward", "quotaio", "chunksN", "delayN", "hN", "densityN", "olrN", "momN",
            "replicas", "async", "streaming")
STREAMING_FRAGMENTS = 4


@dataclass(frozen=True)
class Numbered:
    """A `{prefix}N` variant: N in [lo, hi] sets the run's `section.setting` to N * scale."""

    section: str
    setting: str
    lo: int
    hi: int
    scale: float
    strategies: tuple[str, ...]
    # The strategies, as an error message names them.
    who: str
    # What it adds to the strategy's label, formatted with n (N) and value (N * scale).
    label: str

    def value(self, n: int) -> float | int:
        """The setting's value for N: N itself for counts, else N * scale."""
        return n if self.scale == 1 else n * self.scale


_PS, _LOCAL = "the PS strategies", "the local SGD strategies"
NUMBERED = {
    "chunks": Numbered("compression", "pipeline_chunks", 1, 64, 1, PS_STRATEGIES, _PS, " + {n} chunks"),
    "delay": Numbered("local_sgd", "outer_delay", 0, 1_000_000, 1, LOCAL_SGD_STRATEGIES, _LOCAL, ", outer delay {n}"),
    "h": Numbered("local_sgd", "sync_every", 1, 1_000_000, 1, LOCAL_SGD_STRATEGIES, _LOCAL, ", H = {n}"),
    "density": Numbered("local_sgd", "outer_density", 1, 100, 0.01, (DILOCO_GC,), DILOCO_GC, ", density {n} %"),
    "olr": Numbered("local_sgd", "outer_lr", 1, 1000, 0.01, LOCAL_SGD_STRATEGIES, _LOCAL, ", outer lr {value:g}"),
    "mom": Numbered("local_sgd", "outer_momentum", 0, 99, 0.01, LOCAL_SGD_STRATEGIES, _LOCAL, ", outer momentum {value:g}"),
}  # fmt: skip


def numbered(part: str) -> tuple[Numbered, int] | None:
    """A `{prefix}N` variant's kind and N (None for any other part, or N out of its range)."""
    for prefix, kind in NUMBERED.items():
        digits = part.removeprefix(prefix)
        if part.startswith(prefix) and digits.isdigit() and kind.lo <= int(digits) <= kind.hi:
            return kind, int(digits)
    return None


def numbered_label(part: str) -> str | None:
    """What a numbered variant adds to its strategy's label (None for any other part)."""
    if (found := numbered(part)) is None:
        return None
    kind, n = found
    return kind.label.format(n=n, value=kind.value(n))


def variant_parts(variant: str) -> list[str]:
    """`h100+density5` -> [h100, density5]: an entry's variants, applied in order."""
    return variant.split("+") if variant else []


def strategy_variant(entry: str) -> tuple[str, str]:
    """`ps-bz-gc+sites` -> (ps-bz-gc, "sites"); a plain strategy's variant is "", several
    variants stay joined (`diloco-gc+h100+density5` -> (diloco-gc, "h100+density5"))."""
    strategy, variant = split_entry(entry)
    for part in variant_parts(variant):
        _check_variant(entry, strategy, part)
    return strategy, variant


def _check_variant(entry: str, strategy: str, part: str) -> None:
    found = numbered(part)
    if part not in VARIANTS and found is None:
        raise TestbedError(f"--strategies: {entry!r}: the variants are {', '.join('+' + v for v in VARIANTS)}")
    if found is not None and strategy not in found[0].strategies:
        raise TestbedError(f"--strategies: {entry!r}: +{part} is for {found[0].who}")
    if part in ("sites", "inforward") and strategy not in PS_STRATEGIES:
        raise TestbedError(f"--strategies: {entry!r}: +{part} is for {_PS}")
    if part in ("replicas", "async", "streaming") and strategy not in LOCAL_SGD_STRATEGIES:
        raise TestbedError(f"--strategies: {entry!r}: +{part} is for {_LOCAL}")
    if part == "fp8" and strategy not in COMPRESSING_STRATEGIES:
        raise TestbedError(f"--strategies: {entry!r}: +fp8 is for the PS strategies that compress "
                           f"({', '.join(COMPRESSING_STRATEGIES)})")
    if part == "fp32" and strategy not in (*COMPRESSING_STRATEGIES, *LOCAL_SGD_STRATEGIES):
        raise TestbedError(f"--strategies: {entry!r}: +fp32 is for {_LOCAL} and the PS strategies that compress")


def variant_body(body: dict[str, Any], variant: str) -> dict[str, Any]:
    """The run body of `variant` (see VARIANTS; several joined by `+` apply in order) from the
    strategy's own."""
    for part in variant_parts(variant):
        body = _part_body(body, part)
    return body


def _part_body(body: dict[str, Any], variant: str) -> dict[str, Any]:
    if variant == "plain":
        return body | {"name": f"{body['name']}-plain", "encrypt_links": False}
    if variant == "sites":
        return body | {"name": f"{body['name']}-sites",
                       "compression": body.get("compression", {}) | {"aggregate_at_sites": True}}
    if variant in ("fp8", "fp32"):
        return body | {"name": f"{body['name']}-{variant}",
                       "compression": body.get("compression", {}) | {"value_dtype": variant}}
    if variant == "inforward":
        return body | {"name": f"{body['name']}-inforward",
                       "compression": body.get("compression", {}) | {"apply_in_forward": True}}
    if variant == "quotaio":
        return body | {"name": f"{body['name']}-quotaio"}
    if variant == "replicas":
        return body | {"name": f"{body['name']}-replicas",
                       "local_sgd": body.get("local_sgd", {}) | {"site_replicas": True}}
    if variant == "async":
        # Asynchronous outer steps replace the fixed delay a workload may set.
        local = {k: v for k, v in body.get("local_sgd", {}).items() if k != "outer_delay"}
        return body | {"name": f"{body['name']}-async", "local_sgd": local | {"asynchronous": True}}
    if variant == "streaming":
        local_sgd = body.get("local_sgd", {})
        fragments = min(STREAMING_FRAGMENTS, local_sgd.get("sync_every") or DEFAULT_SYNC_EVERY)
        return body | {"name": f"{body['name']}-streaming", "local_sgd": local_sgd | {"fragments": fragments}}
    if (found := numbered(variant)) is not None:
        kind, n = found
        return body | {"name": f"{body['name']}-{variant}",
                       kind.section: body.get(kind.section, {}) | {kind.setting: kind.value(n)}}
    return body


def split_entry(entry: str) -> tuple[str, str]:
    """`ps-bz-gc+sites` -> (ps-bz-gc, "sites"), unchecked: for entries already through strategy_variant."""
    strategy, _, variant = entry.partition("+")
    return strategy, variant
