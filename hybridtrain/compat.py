"""What combines with what: the one table of a run's options against its strategy and each other.

The run's typed options (`hybridtrain.train_options.TrainOptions`: the API's request, the launch
order, the trainer's command line mapped into it) and anything else that takes a run's options
ask `problems`; each words the answer for its own audience (a request field, a flag), so a rule
is written once and every door refuses the same runs. Options are named as the sections of
`TrainOptions` name them. Standard library only, like the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridtrain.contract import (
    ALLREDUCE_POWERSGD,
    DEFAULT_SYNC_EVERY,
    DILOCO_GC,
    LOCAL_SGD_STRATEGIES,
    PS,
    PS_BZ_GC,
    PS_GC,
    PS_STRATEGIES,
)
from hybridtrain.strategy_defaults import default_by_name

# The parameter-server strategies that exchange every step.
PER_STEP_PS = (PS, PS_GC, PS_BZ_GC)

# option -> (the strategies that take it, what it does, said of the strategies that do not).
TAKES: dict[str, tuple[tuple[str, ...], str]] = {
    "pipeline_chunks": (PS_STRATEGIES, "pipelines a parameter server's exchange"),
    "rebalance_every": (PS_STRATEGIES, "re-splits a parameter server's batch from measured times"),
    "aggregate_at_sites": (PER_STEP_PS, "combines each remote site's per-step gradients at its relay"),
    "apply_in_forward": ((PS_GC, PS_BZ_GC), "applies a compressing parameter server's per-step update "
                                            "in chunks during the next forward pass"),
    "sync_every": (LOCAL_SGD_STRATEGIES, "sets the inner steps between local SGD's outer steps"),
    "outer_lr": (LOCAL_SGD_STRATEGIES, "sets local SGD's outer learning rate"),
    "outer_momentum": (LOCAL_SGD_STRATEGIES, "sets local SGD's outer momentum"),
    "outer_density": ((DILOCO_GC,), "sets the top-k density of diloco-gc's parameter change"),
    "outer_delay": (LOCAL_SGD_STRATEGIES, "overlaps local SGD's outer exchange with inner steps"),
    "asynchronous": (LOCAL_SGD_STRATEGIES, "applies each local SGD outer step as soon as it arrives"),
    "max_staleness": (LOCAL_SGD_STRATEGIES, "bounds how late an asynchronous outer step may land"),
    "site_replicas": (LOCAL_SGD_STRATEGIES, "makes each site's workers one local SGD replica"),
    "fragments": (LOCAL_SGD_STRATEGIES, "streams local SGD's outer steps in staggered fragments"),
    "powersgd_rank": ((ALLREDUCE_POWERSGD,), "sets PowerSGD's rank"),
}

# Options that cannot both be on, and why.
CLASHES: tuple[tuple[str, str, str], ...] = (
    ("apply_in_forward", "aggregate_at_sites", "a relay combines its site's chunks"),
    ("outer_delay", "asynchronous", "asynchronous outer steps replace the fixed delay"),
    # A site's workers step on one mean gradient and must take each outer step at the same inner
    # step to stay one replica; each would see the update arrive at its own time.
    ("asynchronous", "site_replicas", "a site's workers must apply each outer step at the same inner step"),
    # A site's relay combines and fans out whole outer steps; a fragment's round is not built there.
    ("fragments", "site_replicas", "a site's relay exchanges the whole model at each outer step"),
)

# An option on needs another option's value to pass a test: (option, other, test, what it needs).
# An unset other is the strategy's default (hybridtrain.strategy_defaults).
NEEDS: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("apply_in_forward", "pipeline_chunks", lambda v: (v or 1) > 1, "the update in chunks: more than one"),
    ("apply_in_forward", "momentum_correction", lambda v: v is not False,
     "it on: each chunk is applied as plain SGD, the momentum being in the compressed gradient"),
    ("max_staleness", "asynchronous", lambda v: v is True, "it on, being the bound of asynchronous outer steps"),
    ("apply_in_forward", "compressor", lambda v: v != "none", "a compressor other than none"),
)


@dataclass(frozen=True)
class Problem:
    """One rule a run's options break: `option` is not for `strategy` (`other` None), clashes with
    `other` (kind "clash"), or needs `other` to be as `why` says (kind "needs")."""

    kind: str  # "strategy", "clash" or "needs"
    option: str
    why: str
    other: str | None = None


def is_on(option: str, value: Any) -> bool:
    """Whether `value` asks for `option` (a flag on, a value given; one pipeline chunk is none)."""
    if value is None or value is False:
        return False
    return not (option in ("pipeline_chunks", "fragments") and value == 1)


def problems(strategy: str, options: Mapping[str, Any]) -> list[Problem]:
    """Every rule `options` (name -> value; None or absent: the default) break under `strategy`."""
    on = {k for k, v in options.items() if is_on(k, v)}
    found = [Problem("strategy", k, TAKES[k][1]) for k in sorted(on & TAKES.keys()) if strategy not in TAKES[k][0]]
    found += [Problem("clash", a, why, b) for a, b, why in CLASHES if a in on and b in on]
    found += [Problem("needs", a, why, b) for a, b, test, why in NEEDS
              if a in on and not test(_or_default(strategy, options, b))]
    # An overlapped outer step must land before the next one is due.
    every = options.get("sync_every") or DEFAULT_SYNC_EVERY
    if "outer_delay" in on and options["outer_delay"] >= every:
        found.append(Problem("needs", "outer_delay", f"more than the delay {options['outer_delay']} (H is {every})",
                             "sync_every"))
    if "asynchronous" in on and every < 2:
        found.append(Problem("needs", "asynchronous", "more than 1: an outer step lands at least one inner step "
                             "after its exchange began", "sync_every"))
    if "max_staleness" in on and options["max_staleness"] >= every:
        found.append(Problem("needs", "max_staleness", f"more than the bound {options['max_staleness']} "
                             f"(H is {every})", "sync_every"))
    # At most one fragment's outer step a step (hybridtrain.contract.fragment_offsets).
    if "fragments" in on and options["fragments"] > every:
        found.append(Problem("needs", "fragments", f"at least the {options['fragments']} fragments (H is {every})",
                             "sync_every"))
    return found


def _or_default(strategy: str, options: Mapping[str, Any], option: str) -> Any:
    value = options.get(option)
    return default_by_name(strategy, option) if value is None else value


def for_strategy(strategy: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` with those `strategy` does not take cleared (None): the same request planned for
    another strategy (the plan preview's side-by-side, the optimizer's suggestion)."""
    return {k: (None if k in TAKES and strategy not in TAKES[k][0] else v) for k, v in options.items()}


def takers(option: str) -> tuple[str, ...]:
    """The strategies that take `option`."""
    return TAKES[option][0]


def describe(problem: Problem, strategy: str, name: Callable[[str], str]) -> str:
    """One line for `problem`, the options named by `name` (a request field, a flag)."""
    if problem.kind == "strategy":
        return (f"{name(problem.option)} {problem.why}; {strategy} has none (only "
                f"{', '.join(takers(problem.option))})")
    assert problem.other is not None
    if problem.kind == "clash":
        return f"{name(problem.option)} and {name(problem.other)} do not go together: {problem.why}"
    return f"{name(problem.option)} needs {name(problem.other)}: {problem.why}"
