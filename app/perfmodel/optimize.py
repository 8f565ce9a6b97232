"""The placement search: which nodes, which strategy and where the server, for a goal.

`optimize` tries every subset of the candidate nodes (greedy removal beyond `EXHAUSTIVE_MAX`),
every strategy asked for and, for parameter-server strategies, every candidate as the server
(for ps-gc; ps and ps-bz-gc try the SERVER_SHORTLIST servers best for ps-gc on the same nodes),
predicts each plan (`app.perfmodel.predict.predict`) and prices an hour of it (`predict_costs`), and keeps
the best under the goal:

- `Goal.cost`: the lowest $/1M samples (ties: more samples/s);
- `Goal.fastest`: the most samples/s (ties: lower $/1M samples);

among the plans within `budget_usd_per_h` (egress + compute + the data sets' reads spread over
the run) and finishing `max_steps` within `deadline_s`. The data sets' reads
(`app.perfmodel.data.predict_reads`: bytes fetched from each store by a site's cache, else by
each node, times the epochs fetched, priced by traffic class) count in $/h and $/1M samples, so
with the data in one cloud a plan near it can come out cheapest. Its explanation (`app.perfmodel.explain`) compares it,
in numbers a person can check, with the best plan on all the candidates, says where the server went
and what the next-best server would cost, and what the data sets' reads cost.

Inputs:

- `Candidate(node, usage, max_batch=None)`: `node` is the model's `NodeSpec` (the task's profile
  there); `usage` an `app.billing.NodeUsage` giving its site and pricing (its `seconds` are
  ignored); the name of both must be the same; `data_cache` how its agent reads data sets.
- batch split: `ps-bz-gc` splits the global batch in proportion to the nodes' samples/s (the
  measured speeds), every other strategy equally, as the trainer's defaults do.
- `NoPlanError(field, message, cheapest)`: no plan meets the budget (field
  `budget_usd_per_h`; `cheapest` the plan of lowest $/h there is) or the deadline (field
  `deadline_s`; `cheapest` the fastest plan within the budget).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from app.billing import NodeUsage, PriceLookup, Site
from app.errors import InvalidFieldError
from app.perfmodel.data import NO_READS, DataCache, DataReads, DataSetSpec, predict_reads
from app.perfmodel.explain import describe, explain
from app.perfmodel.predict import (
    CompressionSpec,
    CostPrediction,
    LinkSpec,
    NodeSpec,
    Prediction,
    TaskSpec,
    predict,
    predict_costs,
)
from hybridtrain.contract import PS_BZ_GC, PS_GC, STRATEGIES, equal_batch_sizes, is_ps, proportional_batch_sizes

# All 2^n - 1 subsets up to here (1023 at 10 candidates); greedy removal beyond.
EXHAUSTIVE_MAX = 10
# Where the pilot strategy ranks the servers, the other PS strategies try its best this many:
# a server's place decides links and egress prices alike for every PS strategy.
SERVER_SHORTLIST = 3


class Goal(StrEnum):
    """What "best" means: the lowest $/1M samples, or the most samples/s."""

    cost = "cost"
    fastest = "fastest"


@dataclass(frozen=True)
class Candidate:
    """A node the plan may use: its performance figures and its site and pricing."""

    node: NodeSpec
    usage: NodeUsage
    data_cache: DataCache = DataCache()

    @property
    def site(self) -> Site:
        return self.usage.site


@dataclass(frozen=True)
class PlanChoice:
    """One evaluated plan: strategy, server, workers with their batch shares, its prediction and
    the cost of an hour."""

    strategy: str
    server_node_id: int | None
    workers: tuple[tuple[int, int], ...]  # (node id, batch share)
    prediction: Prediction
    costs: CostPrediction
    reads: DataReads = NO_READS

    @property
    def node_ids(self) -> tuple[int, ...]:
        """The worker nodes, in order."""
        return tuple(n for n, _ in self.workers)

    @property
    def usd_per_h(self) -> float:
        return self.costs.total_usd_per_h

    @property
    def usd_per_million(self) -> float:
        """$/1M samples (infinite when nothing is trained)."""
        v = self.costs.usd_per_million_samples
        return math.inf if v is None else v

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {"strategy": self.strategy, "server_node_id": self.server_node_id,
                "node_ids": list(self.node_ids), "batch_sizes": [n for _, n in self.workers],
                "prediction": self.prediction.to_dict(), "costs": self.costs.to_dict(),
                "data_reads": self.reads.to_dict()}


@dataclass(frozen=True)
class OptimizeResult:
    """The chosen plan, the best plan on all candidates, and why the one beats the other."""

    best: PlanChoice
    baseline: PlanChoice | None
    explanation: str
    goal: Goal
    evaluated: int
    left_out: tuple[int, ...] = ()
    runners_up: tuple[PlanChoice, ...] = field(default=())

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {"best": self.best.to_dict(), "baseline": self.baseline.to_dict() if self.baseline else None,
                "explanation": self.explanation, "goal": self.goal.value, "evaluated": self.evaluated,
                "left_out": list(self.left_out), "runners_up": [p.to_dict() for p in self.runners_up]}


class NoPlanError(InvalidFieldError):
    """No plan meets the budget or the deadline; `cheapest` is the nearest plan there is."""

    def __init__(self, field: str, message: str, cheapest: PlanChoice | None) -> None:
        super().__init__(field, message)
        self.cheapest = cheapest


def _batch_split(strategy: str, nodes: Sequence[NodeSpec], global_batch: int) -> list[int]:
    if strategy == PS_BZ_GC:
        return proportional_batch_sizes(global_batch, [n.samples_per_s for n in nodes])
    return equal_batch_sizes(global_batch, len(nodes))


class _Search:
    """Evaluates plans once each (memoised by strategy, server and subset)."""

    def __init__(self, candidates: Sequence[Candidate], *, global_batch: int, links: Mapping[tuple[int, int], LinkSpec],
                 task: TaskSpec, compression: CompressionSpec | Mapping[str, CompressionSpec], prices: PriceLookup,
                 at: datetime, relay: bool, max_steps: int | None, strategies: Sequence[str],
                 servers: Sequence[int] | None, key, budget: float | None, deadline: float | None,
                 datasets: Sequence[DataSetSpec] = (), epochs: float | None = None) -> None:
        self.key, self.budget, self.deadline = key, budget, deadline
        self.datasets, self.epochs = datasets, epochs
        self.reads: dict[tuple[int, ...], DataReads] = {}
        self.by_id = {c.node.node_id: c for c in candidates}
        self.global_batch, self.links, self.task = global_batch, links, task
        self.compression, self.prices, self.at = compression, prices, at
        self.relay, self.max_steps, self.strategies = relay, max_steps, strategies
        self.servers = list(servers) if servers is not None else list(self.by_id)
        self.cache: dict[tuple, PlanChoice] = {}

    def plan(self, strategy: str, subset: tuple[int, ...], server: int | None) -> PlanChoice:
        key = (strategy, subset, server)
        if key not in self.cache:
            nodes = [self.by_id[i].node for i in subset]
            shares = _batch_split(strategy, nodes, self.global_batch)
            srv = self.by_id[server].node if server is not None else None
            # The densities' fixed point depends on the links, not on the batch split: ps-gc's
            # serve ps-bz-gc on the same nodes and server.
            twin = self.cache.get(({PS_BZ_GC: PS_GC, PS_GC: PS_BZ_GC}.get(strategy), subset, server))
            densities = [r["density"] for r in twin.prediction.per_worker] if twin else None
            comp = self.compression[strategy] if isinstance(self.compression, Mapping) else self.compression
            pred = predict(strategy, workers=list(zip(nodes, shares)), server=srv, links=self.links,
                           task=self.task, compression=comp, relay=self.relay,
                           max_steps=self.max_steps, densities=densities)
            reads = self.reads_of(subset)
            costs = predict_costs(pred, nodes=[c.usage for c in self.by_id.values()], prices=self.prices,
                                  at=self.at, reads=reads)
            self.cache[key] = PlanChoice(strategy, server, tuple(zip(subset, shares)), pred, costs, reads)
        return self.cache[key]

    def reads_of(self, subset: tuple[int, ...]) -> DataReads:
        """The data sets' reads by the workers `subset` (the same for every strategy and server)."""
        if not self.datasets:
            return NO_READS
        if subset not in self.reads:
            nodes = [(self.by_id[i].usage, self.by_id[i].data_cache) for i in subset]
            self.reads[subset] = predict_reads(self.datasets, nodes, global_batch=self.global_batch,
                                               max_steps=self.max_steps, epochs=self.epochs,
                                               prices=self.prices, at=self.at)
        return self.reads[subset]

    def plans_for(self, subset: tuple[int, ...]) -> list[PlanChoice]:
        """Every strategy on `subset`; a PS strategy's server on every candidate for the pilot
        strategy (ps-gc where asked for), on the pilot's best SERVER_SHORTLIST for the others."""
        out = [self.plan(s, subset, None) for s in self.strategies if not is_ps(s)]
        ps = [s for s in self.strategies if is_ps(s)]
        if not ps:
            return out
        pilot = PS_GC if PS_GC in ps else ps[0]
        tried = sorted((self.plan(pilot, subset, srv) for srv in self.servers),
                       key=lambda p: (not _fits(p, self.budget, self.deadline), self.key(p)))
        out.extend(tried)
        shortlist = [p.server_node_id for p in tried[:SERVER_SHORTLIST]]
        out.extend(self.plan(s, subset, srv) for s in ps if s != pilot for srv in shortlist)
        return out


def _key(goal: Goal):
    if goal is Goal.cost:
        return lambda p: (p.usd_per_million, -p.prediction.samples_per_s)
    return lambda p: (-p.prediction.samples_per_s, p.usd_per_million)


def _fits(p: PlanChoice, budget: float | None, deadline: float | None) -> bool:
    if budget is not None and p.usd_per_h > budget + 1e-9:
        return False
    if deadline is not None and (p.prediction.time_to_max_steps_s or math.inf) > deadline:
        return False
    return True


def optimize(candidates: Sequence[Candidate], *, global_batch: int, goal: Goal | str,
             links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec, prices: PriceLookup, at: datetime,
             compression: CompressionSpec | Mapping[str, CompressionSpec] = CompressionSpec(),
             budget_usd_per_h: float | None = None,
             deadline_s: float | None = None, max_steps: int | None = None,
             strategies: Sequence[str] = STRATEGIES, relay: bool = True,
             servers: Sequence[int] | None = None, datasets: Sequence[DataSetSpec] = (),
             epochs: float | None = None) -> OptimizeResult:
    """The best plan over node subsets x strategies x server placements for `goal`, within the
    budget and deadline; `servers` limits where a parameter server may go; `compression` is one
    spec for every strategy, or each strategy's own (its defaults differ: app.queries.predictions);
    the workers' reads of `datasets` (over `max_steps`, else `epochs`, else one epoch) count in the cost."""
    goal = _check(candidates, global_batch, goal, budget_usd_per_h, deadline_s, max_steps, strategies, servers)
    search = _Search(candidates, global_batch=global_batch, links=links, task=task, compression=compression,
                     prices=prices, at=at, relay=relay, max_steps=max_steps, strategies=strategies,
                     servers=servers, key=_key(goal), budget=budget_usd_per_h, deadline=deadline_s,
                     datasets=datasets, epochs=epochs)
    ids = tuple(c.node.node_id for c in candidates)
    key = search.key
    usable = [s for s in _subsets(ids, global_batch, search, key, budget_usd_per_h, deadline_s)]
    plans = [p for s in usable for p in search.plans_for(s)]
    fitting = sorted((p for p in plans if _fits(p, budget_usd_per_h, deadline_s)), key=key)
    if not fitting:
        raise _no_plan(plans, budget_usd_per_h, deadline_s)
    best = fitting[0]
    all_plans = search.plans_for(ids) if len(ids) <= global_batch else []
    baseline = min(all_plans, key=key) if all_plans else None
    left_out = tuple(i for i in ids if i not in best.node_ids)
    runners = tuple(_runners_up(fitting, best))
    why = explain(best, baseline, goal, next_server=_next_server(best, goal, search),
                  ruled_out=_why_not(baseline, search))
    return OptimizeResult(best, baseline, why, goal, len(search.cache),
                          left_out, runners)


def _check(candidates: Sequence[Candidate], global_batch: int, goal: Goal | str, budget: float | None,
           deadline: float | None, max_steps: int | None, strategies: Sequence[str],
           servers: Sequence[int] | None) -> Goal:
    if not candidates:
        raise InvalidFieldError("candidates", "candidates: at least one node is required")
    ids = [c.node.node_id for c in candidates]
    if len(set(ids)) != len(ids):
        raise InvalidFieldError("candidates", f"candidates: node ids repeat in {ids}")
    for c in candidates:
        if c.node.name != c.usage.name:
            raise InvalidFieldError("candidates", f"candidates: node {c.node.name!r} is priced as {c.usage.name!r}")
    try:
        goal = Goal(goal)
    except ValueError:
        raise InvalidFieldError("goal", f"goal {goal!r}: expected one of {', '.join(g.value for g in Goal)}") from None
    if global_batch < 1:
        raise InvalidFieldError("global_batch", f"global_batch must be >= 1, got {global_batch}")
    if budget is not None and not budget >= 0:
        raise InvalidFieldError("budget_usd_per_h", f"budget_usd_per_h must be >= 0, got {budget}")
    if deadline is not None:
        if not deadline > 0:
            raise InvalidFieldError("deadline_s", f"deadline_s must be > 0, got {deadline}")
        if max_steps is None:
            raise InvalidFieldError("max_steps", "max_steps: a deadline needs the run's length in steps")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise InvalidFieldError("strategies",
                                f"strategies {list(strategies)}: expected some of {', '.join(STRATEGIES)}")
    if servers is not None:
        bad = [s for s in servers if s not in ids]
        if bad or (not servers and any(is_ps(s) for s in strategies)):
            raise InvalidFieldError("servers", f"servers {list(servers)}: must be among the candidates {ids}")
    return goal


def _subsets(ids: tuple[int, ...], global_batch: int, search: _Search, key, budget: float | None,
             deadline: float | None):
    """Every non-empty subset the batch can cover, or, beyond EXHAUSTIVE_MAX candidates, the
    path of greedy removal: drop the node whose removal gives the best plan, while it helps."""
    if len(ids) <= EXHAUSTIVE_MAX:
        for r in range(len(ids), 0, -1):
            if r <= global_batch:
                yield from itertools.combinations(ids, r)
        return
    current = ids[:global_batch] if len(ids) > global_batch else ids

    def rank(p: PlanChoice) -> tuple:
        # A plan within the constraints beats any outside them; then the goal decides.
        return (not _fits(p, budget, deadline), key(p))

    def best_of(subset: tuple[int, ...]) -> tuple:
        return min(rank(p) for p in search.plans_for(subset))

    yield current
    score = best_of(current)
    while len(current) > 1:
        options = [tuple(i for i in current if i != drop) for drop in current]
        cand, subset = min((best_of(s), s) for s in options)
        if not cand < score:
            return
        yield subset
        current, score = subset, cand


def _no_plan(plans: list[PlanChoice], budget: float | None, deadline: float | None) -> NoPlanError:
    within = [p for p in plans if _fits(p, budget, None)]
    if budget is not None and not within:
        cheapest = min(plans, key=lambda p: (p.usd_per_h, -p.prediction.samples_per_s))
        return NoPlanError("budget_usd_per_h",
                           f"budget_usd_per_h: no plan costs at most ${budget:.2f}/h; the cheapest is "
                           f"{describe(cheapest)} at ${cheapest.usd_per_h:.2f}/h", cheapest)
    fastest = min(within, key=lambda p: (p.prediction.time_to_max_steps_s or math.inf, p.usd_per_h))
    return NoPlanError("deadline_s",
                       f"deadline_s: no plan{' within the budget' if budget is not None else ''} finishes in "
                       f"{deadline:.0f} s; the fastest is {describe(fastest)} in "
                       f"{fastest.prediction.time_to_max_steps_s:.0f} s at ${fastest.usd_per_h:.2f}/h", fastest)


def _runners_up(fitting: list[PlanChoice], best: PlanChoice) -> list[PlanChoice]:
    """The best plan of each other strategy, for a side-by-side view."""
    seen, out = {best.strategy}, []
    for p in fitting:
        if p.strategy not in seen:
            seen.add(p.strategy)
            out.append(p)
    return out


def _next_server(best: PlanChoice, goal: Goal, search: _Search) -> PlanChoice | None:
    """The best plan of `best`'s strategy and nodes with the server anywhere else, if it has one."""
    if best.server_node_id is None:
        return None
    alts = [search.plan(best.strategy, best.node_ids, s) for s in search.servers if s != best.server_node_id]
    return min(alts, key=_key(goal)) if alts else None


def _why_not(baseline: PlanChoice | None, search: _Search) -> str:
    """Why the plan on every candidate was not chosen, when a limit ruled it out."""
    if baseline is None:
        return ""
    if not _fits(baseline, search.budget, None):
        return f"${baseline.usd_per_h:.3g}/h, over the budget"
    if not _fits(baseline, None, search.deadline):
        return f"{baseline.prediction.time_to_max_steps_s:.0f} s, past the deadline"
    return ""


__all__ = ["Candidate", "EXHAUSTIVE_MAX", "Goal", "NoPlanError", "OptimizeResult", "PlanChoice", "optimize"]
