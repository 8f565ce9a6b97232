"""What a run gets for the options it leaves unset, per strategy: the configuration the paper
benchmark measured best, so that a run launched with the defaults is the run benchmarked.

One table, keyed by the options' paths in a request (`hybridtrain.train_options.TrainOptions`:
"compression.density", "local_sgd.sync_every", "rebalance_every"), that the trainer
(trainer.run_options), the prediction (app.queries.predictions), the API's schema, the launch
form and both command lines read. An option a strategy has no entry for falls to the trainer's
own default (trainer.config.TrainConfig), which is the same for every strategy. The benchmark's
workload (bench/paper/paper_workloads.py FULL) sets only what is its own and runs these; a test
keeps the two apart. Standard library only, like the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridtrain.contract import (
    DEFAULT_OUTER_DENSITY,
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    DEFAULT_SYNC_EVERY,
    DILOCO_GC,
    LOCAL_SGD_STRATEGIES,
    PS_BZ_GC,
    PS_GC,
    PS_STRATEGIES,
    STRATEGIES,
)

# The parameter-server strategies that compress every step's gradient (diloco-gc's one knob is
# local_sgd.outer_density).
_COMPRESSING_PS = (PS_GC, PS_BZ_GC)

# The inner steps an outer step lands after its exchange began: none, so the next inner steps
# start from the new common model. Overlapping the exchange with 3 of them hid the workers'
# wait (0.03-0.18 s at an outer step against 0.4-1.6 s) but the stale steps cost more samples
# than the wait: widecnn crossed 0.95 at step 30 without, 33-36 with (16 % and 7 % more time,
# diloco and diloco-gc), and charlm with sites as replicas reached val_loss 0.9 in 19.5 s
# against 22.4 s (3 seeds; docs/CHANGELOG.md, 2026-12-07).
DEFAULT_OUTER_DELAY = 0

# option path -> {strategy: value}. Where a value comes from: docs/testbed.md, "Choosing the
# workload" (the widecnn workload these were chosen on) and docs/BENCHMARKS.md, "Paper benchmark".
TABLE: dict[str, dict[str, Any]] = {
    # The step in 4 pipelined chunks, one on the wire and at the server while the workers compress
    # the next: 29 % less overhead than one chunk (docs/CHANGELOG.md, 4bf7ae2), and 8 or 16 do not
    # shorten it further (docs/BENCHMARKS.md, "Pipeline chunks, A/B"). Every PS strategy, local SGD's
    # exchange too: the benchmark gives the baselines every systems improvement that is not the method.
    "compression.pipeline_chunks": dict.fromkeys(PS_STRATEGIES, 4),
    # Top-k density adapted per worker around 5 % within [2 %, 10 %]: links fast enough to sit under
    # the trainer's 50 ms time floor send more, workers sharing the WAN less.
    "compression.density": dict.fromkeys(_COMPRESSING_PS, 0.05),
    "compression.density_min": dict.fromkeys(_COMPRESSING_PS, 0.02),
    "compression.density_max": dict.fromkeys(_COMPRESSING_PS, 0.1),
    # The server keeps params/8 of the aggregate: with momentum correction params/8 and params/4
    # both crossed 0.95 at step 25 and ended level, and params/8 halves the update on the WAN and
    # the server's work; params/32 (the paper's) cost 6 points of accuracy at 30 steps.
    "compression.server_k_fraction": dict.fromkeys(_COMPRESSING_PS, 0.125),
    # One dense warm-up step, not five: with momentum correction ps-bz-gc reached 0.95 at step 25
    # either way, and a dense step costs as much as a `ps` step.
    "compression.warmup_steps": dict.fromkeys(_COMPRESSING_PS, 1),
    # Re-split the batch from measured compute and compression times: ps-bz-gc every 5 steps (FLOPs
    # ignore that a small batch runs less efficiently per core; the re-split closes that gap after
    # the warm-up), local SGD at every outer step, so its workers reach each one together.
    "rebalance_every": {PS_BZ_GC: 5} | dict.fromkeys(LOCAL_SGD_STRATEGIES, 1),
    # Local SGD's outer optimizer: hybridtrain.contract says why each.
    "local_sgd.sync_every": dict.fromkeys(LOCAL_SGD_STRATEGIES, DEFAULT_SYNC_EVERY),
    "local_sgd.outer_lr": dict.fromkeys(LOCAL_SGD_STRATEGIES, DEFAULT_OUTER_LR),
    "local_sgd.outer_momentum": dict.fromkeys(LOCAL_SGD_STRATEGIES, DEFAULT_OUTER_MOMENTUM),
    "local_sgd.outer_density": {DILOCO_GC: DEFAULT_OUTER_DENSITY},
    "local_sgd.outer_delay": dict.fromkeys(LOCAL_SGD_STRATEGIES, DEFAULT_OUTER_DELAY),
}

# Defaults that follow another option when the run gives that one: option path -> (the option it
# follows, the rule). A density given alone keeps the benchmarked band around it ([0.4 d, 2 d]),
# rather than bounds that may not contain it.
DERIVED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "compression.density_min": ("compression.density", lambda d: d / 2.5),
    "compression.density_max": ("compression.density", lambda d: min(1.0, 2 * d)),
}


# Defaults that an option given switches off: option path -> the option that replaces it.
# Asynchronous outer steps land when they arrive, not a fixed delay later.
REPLACED_BY: dict[str, str] = {"local_sgd.outer_delay": "local_sgd.asynchronous"}


def defaults(strategy: str, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The options `strategy` gets for those that `given` (path -> value, None: unset) leaves
    unset, by path: the table's, or what follows from an option given (DERIVED)."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    out: dict[str, Any] = {}
    for path, values in TABLE.items():
        if path in given or strategy not in values or given.get(REPLACED_BY.get(path, "")):
            continue
        source, rule = DERIVED.get(path, ("", None))
        out[path] = rule(given[source]) if rule is not None and source in given else values[strategy]
    return out


def effective(strategy: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """A request's options in its shape ({"compression": {...}, "local_sgd": {...},
    "rebalance_every": N}, unset ones None or absent) with `strategy`'s defaults filled in."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in options.items()}
    flat: dict[str, Any] = {}
    for key, value in options.items():
        flat |= {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, Mapping) else {key: value}
    for path, value in defaults(strategy, flat).items():
        section, _, name = path.rpartition(".")
        if section:
            out[section] = (out.get(section) or {}) | {name: value}
        else:
            out[name] = value
    return out


def default(strategy: str, path: str) -> Any:
    """The table's value of `path` for `strategy` (None: the trainer's own default)."""
    return TABLE.get(path, {}).get(strategy)


def default_by_name(strategy: str, option: str) -> Any:
    """`default` of an option named as hybridtrain.compat names them ('pipeline_chunks')."""
    for path, values in TABLE.items():
        if path.rpartition(".")[2] == option:
            return values.get(strategy)
    return None


def describe(path: str) -> str:
    """The defaults of `path` in words, for help texts and schema descriptions: '4 for ps, ps-gc,
    ps-bz-gc, diloco, diloco-gc' or '5 for ps-bz-gc, 1 for diloco, diloco-gc'."""
    by_value: dict[Any, list[str]] = {}
    for strategy in STRATEGIES:
        if strategy in TABLE[path]:
            by_value.setdefault(TABLE[path][strategy], []).append(strategy)
    return "; ".join(f"{value:g} for {', '.join(names)}" for value, names in by_value.items())
