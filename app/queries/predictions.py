"""Predictions from what the database holds: the model's inputs for a set of nodes, a plan's
predicted step and hour, the server placement the model prefers, and the optimizer's choice.

The model itself is pure (`app.perfmodel.predict`, `app.perfmodel.optimize`); this module
gathers its figures: each node's newest finished profile of the task (`result` JSON), the links
between the nodes (`app.queries.links.link_estimates`: measured, declared or assumed), and the
prices in force (`DbPriceLookup`, with each node priced as its bill prices it,
`app.queries.costs.node_usage`); and, once a run has run, its prediction beside what it measured
(`predicted_vs_measured`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from app.billing import Bill, NodeUsage, PriceLookup, Site
from app.errors import InvalidFieldError
from app.models import Node, Run
from app.perfmodel.data import NO_READS, DataCache, DataReads, DataSetSpec, predict_reads
from app.perfmodel.optimize import Candidate, OptimizeResult, optimize
from app.perfmodel.predict import CompressionSpec, LinkSpec, NodeSpec, TaskSpec, predict, predict_costs
from app.planner import Plan, PlanNode
from app.queries.costs import metric_totals, node_usage, run_sites_by_rank
from app.queries.price_lookups import CachedPriceLookup, DbPriceLookup
from app.queries.profiles import SCRIPT_PREFIX, latest_profiles, task_key
from app.schemas.runs import CompressionOptions, LocalSgdOptions
from hybridtrain import strategy_defaults
from hybridtrain.contract import STRATEGIES, VALUE_BYTES, is_local_sgd, is_ps

# How the comparison names a local SGD strategy run with sites as replicas ("diloco+replicas").
REPLICAS_SUFFIX = "+replicas"
# The profile fields without which the model cannot size a step.
_REQUIRED = ("params", "dense_params", "samples_per_s")


@dataclass(frozen=True)
class ModelInputs:
    """Everything the model needs for some nodes: their specs, pricing and sites, the links
    between them, the task's size, the run's compression settings as each strategy would run
    them (`compression_spec`) and the prices."""

    specs: dict[int, NodeSpec]
    usages: dict[int, NodeUsage]
    sites: dict[int, int]
    links: dict[tuple[int, int], LinkSpec]
    measured_at: dict[tuple[int, int], datetime | None]
    task: TaskSpec
    compressions: dict[str, CompressionSpec]
    prices: PriceLookup
    at: datetime
    max_steps: int | None
    # The run's data sets fetched from stores, how each node reads them, and the run's epochs
    # (its length when max_steps is not known).
    datasets: tuple[DataSetSpec, ...] = ()
    data_caches: dict[int, DataCache] = field(default_factory=dict)
    epochs: float | None = None

    def reads(self, node_ids: Sequence[int], global_batch: int) -> DataReads:
        """What the workers on `node_ids` fetch of the run's data sets over the run, priced."""
        if not self.datasets:
            return NO_READS
        nodes = [(self.usages[i], self.data_caches.get(i, DataCache())) for i in dict.fromkeys(node_ids)]
        return predict_reads(self.datasets, nodes, global_batch=global_batch, max_steps=self.max_steps,
                             epochs=self.epochs, prices=self.prices, at=self.at)


def compression_spec(strategy: str, options: CompressionOptions | None, *, eval_every: int | None,
                     local_sgd: LocalSgdOptions | None = None) -> CompressionSpec:
    """The model's view of a run's compression and local SGD options under `strategy`, as its
    trainer runs them (trainer.run_options): the strategy's defaults where unset
    (hybridtrain.strategy_defaults), the trainer's own for the rest."""
    given = {"compression": options.model_dump(exclude_none=True) if options else {},
             "local_sgd": local_sgd.model_dump(exclude_none=True) if local_sgd else {}}
    sections = strategy_defaults.effective(strategy, given)
    changes: dict[str, Any] = {}
    if eval_every is not None:
        changes["eval_every"] = eval_every
    compression = sections["compression"]
    changes |= {name: compression[name] for name in ("density", "density_min", "density_max", "server_k_fraction",
                                                     "warmup_steps", "pipeline_chunks", "compressor", "powersgd_rank")
                if name in compression}
    if "value_dtype" in compression:
        changes["value_bytes"] = VALUE_BYTES[compression["value_dtype"]]
    local = sections["local_sgd"]
    changes |= {name: local[name] for name in ("sync_every", "outer_density", "outer_delay", "fragments")
                if name in local}
    if local.get("asynchronous") and "sync_every" in local:
        # An asynchronous outer step hides its exchange behind up to max_staleness inner steps.
        changes["outer_delay"] = local.get("max_staleness") or local["sync_every"] - 1
    if is_local_sgd(strategy):
        changes["site_replicas"] = bool(local.get("site_replicas"))
    return replace(CompressionSpec(), **changes)


def compression_specs(options: CompressionOptions | None, *, eval_every: int | None,
                      local_sgd: LocalSgdOptions | None = None) -> dict[str, CompressionSpec]:
    """`compression_spec` under every strategy (the side-by-side plans and the optimizer try each)."""
    return {s: compression_spec(s, options, eval_every=eval_every, local_sgd=local_sgd) for s in STRATEGIES}


def _profile_call(task: str, task_args: dict[str, Any], bundle_sha256: str | None, node_ids: list[int]) -> str:
    body: dict[str, Any] = {"task": task, "node_ids": node_ids}
    if task_args:
        body["task_args"] = task_args
    if bundle_sha256:
        body["bundle_sha256"] = bundle_sha256
    return f"POST /api/v1/tasks/profiles {json.dumps(body, sort_keys=True)}"


def model_inputs(
    session: Session,
    *,
    nodes: Sequence[Node],
    task: str,
    task_args: dict[str, Any],
    bundle_sha256: str | None,
    compression: CompressionOptions | None,
    eval_every: int | None,
    max_steps: int | None,
    local_sgd: LocalSgdOptions | None = None,
    at: datetime | None = None,
    datasets: Sequence[str] = (),
    epochs: float | None = None,
) -> ModelInputs | str:
    """The model's inputs for `nodes` (loaded with site and GPUs) and the run's `datasets`, or
    why there are none: the nodes without a usable profile of the task, and the call that
    measures them."""
    from app.queries.datasets import dataset_specs, node_data_cache
    from app.queries.links import link_estimates  # P1's module; imported late to keep start-up light

    ids = list(dict.fromkeys(n.id for n in nodes))
    profiles = latest_profiles(session, task_key=task_key(task, task_args, bundle_sha256), node_ids=ids)
    missing = [n for n in nodes if not usable_profile(profiles.get(n.id))]
    if missing:
        names = ", ".join(f"{n.name} (id {n.id})" for n in missing)
        if task.startswith(SCRIPT_PREFIX):
            return script_unmeasured(task.removeprefix(SCRIPT_PREFIX), task_args, names, [n.id for n in missing])
        return (f"no finished profile of {task} with the model's inputs on node(s) {names}; "
                f"measure it with {_profile_call(task, task_args, bundle_sha256, [n.id for n in missing])} "
                f"(or plan with \"profile_missing\": true)")
    # The task's size is the same everywhere; the newest profile speaks for it.
    newest = max(profiles.values(), key=lambda p: (p.measured_at or datetime.min.replace(tzinfo=UTC), p.id))
    task_spec = TaskSpec.from_profile(newest.result)
    estimates = link_estimates(session, node_ids=ids)
    return ModelInputs(
        specs={n.id: NodeSpec.from_profile(n.id, n.name, n.site_id, profiles[n.id].result) for n in nodes},
        usages={n.id: node_usage(n, 0.0) for n in nodes},
        sites={n.id: n.site_id for n in nodes},
        links={k: LinkSpec(e.mbps, e.rtt_ms, e.source) for k, e in estimates.items()},
        measured_at={k: e.measured_at for k, e in estimates.items()},
        task=task_spec,
        compressions=compression_specs(compression, eval_every=eval_every, local_sgd=local_sgd),
        prices=CachedPriceLookup(DbPriceLookup(session)),
        at=at or datetime.now(UTC),
        max_steps=max_steps,
        datasets=tuple(dataset_specs(session, names=datasets)) if datasets else (),
        data_caches={n.id: node_data_cache(n) for n in nodes},
        epochs=epochs,
    )


def script_unmeasured(script: str, args: dict[str, Any], names: str, node_ids: list[int]) -> str:
    """Why a script has no prediction yet, and the run that gets it one."""
    script_args = " ".join(args.get("script_args") or [])
    return (f"no measured step of script {script} (this code, these arguments) on node(s) {names}: a script "
            "is its own training loop, which the profiler cannot run a step at a time, so it is measured by "
            "running it: a short run of it on these nodes (e.g. `hybridtrain runs create --name measure "
            f"--nodes {','.join(map(str, node_ids))} --workdir . --script {script} --max-steps 30"
            f"{' -- ' + script_args if script_args else ''}`, under the default strategy, whose server reports the "
            "model's size) makes each worker's measured steps its node's "
            "profile, and the next plan predicts from them")


def usable_profile(profile: Any) -> bool:
    """Whether a finished profile carries every input the model needs."""
    result = getattr(profile, "result", None)
    return bool(result) and all(result.get(k) is not None for k in _REQUIRED) and result["samples_per_s"] > 0


def _priced(inputs: ModelInputs, strategy: str, workers: list[tuple[NodeSpec, int]], server: NodeSpec | None,
            compression: CompressionSpec | None = None):
    prediction = predict(strategy, workers=workers, server=server, links=inputs.links, task=inputs.task,
                         compression=compression or inputs.compressions[strategy], relay=True,
                         max_steps=inputs.max_steps)
    node_ids = {w.node_id for w, _ in workers} | ({server.node_id} if server is not None else set())
    reads = inputs.reads([w.node_id for w, _ in workers], sum(n for _, n in workers))
    costs = predict_costs(prediction, nodes=[inputs.usages[i] for i in node_ids], prices=inputs.prices,
                          at=inputs.at, reads=reads)
    return prediction, costs, reads


def _workers(inputs: ModelInputs, plan: Plan) -> list[tuple[NodeSpec, int]]:
    return [(inputs.specs[w.node_id], w.batch_size or 0) for w in plan.workers if w.role == "worker"]


def predict_plan(inputs: ModelInputs, plan: Plan) -> dict[str, Any]:
    """The plan's predicted step and priced hour, JSON-ready (`PredictionPublic`)."""
    server = inputs.specs[plan.ps_node_id] if plan.ps_node_id is not None else None
    prediction, costs, reads = _priced(inputs, plan.strategy, _workers(inputs, plan), server)
    out = prediction.to_dict()
    out["assumptions"] = [*out["assumptions"], *reads.assumptions]
    out["costs"] = costs.to_dict()
    out["egress_bytes_per_step"] = sum(
        b for s, d, b in prediction.bytes_per_step if inputs.sites.get(s) != inputs.sites.get(d)
    )
    out["links"] = [
        {"src_node_id": s, "dst_node_id": d, "mbps": inputs.links[(s, d)].mbps,
         "rtt_ms": inputs.links[(s, d)].rtt_ms, "source": inputs.links[(s, d)].source,
         "measured_at": _iso(inputs.measured_at.get((s, d)))}
        for s, d, _ in prediction.bytes_per_step if (s, d) in inputs.links
    ]
    return _finite(out)


def strategy_variants(inputs: ModelInputs) -> list[tuple[str, CompressionSpec]]:
    """What the comparison predicts: every strategy as the run's options and the strategy's
    defaults give it (`inputs.compressions`), local SGD both with and without sites as replicas."""
    out = []
    for strategy in STRATEGIES:
        spec = inputs.compressions[strategy]
        out.append((strategy, spec))
        if is_local_sgd(strategy):
            out.append((strategy, replace(spec, site_replicas=not spec.site_replicas)))
    return out


def variant_name(strategy: str, spec: CompressionSpec) -> str:
    """'diloco', or 'diloco+replicas' with sites as replicas."""
    return f"{strategy}{REPLICAS_SUFFIX}" if is_local_sgd(strategy) and spec.site_replicas else strategy


def compare_strategies(inputs: ModelInputs, plans: Mapping[str, Plan], chosen: Plan) -> list[dict[str, Any]]:
    """Where each strategy wins on these nodes and links: each variant's predicted samples/s, its
    share of the ideal (the sum of the workers' compute-only rates), WAN bytes per sample and
    $ per 1M samples, under its own plan in `plans` (by strategy), most samples/s first (ties:
    the cheaper); `chosen` marks the plan's own. Variants the model cannot predict are left out."""
    mine = variant_name(chosen.strategy, inputs.compressions[chosen.strategy])
    rows = []
    for strategy, spec in strategy_variants(inputs):
        plan = plans.get(strategy)
        if plan is None:
            continue
        workers = _workers(inputs, plan)
        server = inputs.specs.get(plan.ps_node_id) if plan.ps_node_id is not None else None
        try:
            prediction, costs, _ = _priced(inputs, strategy, workers, server, spec)
        except InvalidFieldError:
            continue
        wan = sum(b for s, d, b in prediction.bytes_per_step if inputs.sites.get(s) != inputs.sites.get(d))
        ideal = sum(w.samples_per_s for w, _ in workers)
        name = variant_name(strategy, spec)
        rows.append(_finite({
            "name": name, "strategy": strategy, "site_replicas": bool(is_local_sgd(strategy) and spec.site_replicas),
            "server_node_id": prediction.server_node_id, "samples_per_s": prediction.samples_per_s,
            "ideal_share": prediction.samples_per_s / ideal, "wan_bytes_per_sample": wan / prediction.global_batch,
            "usd_per_million_samples": costs.usd_per_million_samples, "chosen": name == mine,
        }))
    rows.sort(key=lambda r: (-r["samples_per_s"], math.inf if r["usd_per_million_samples"] is None
                             else r["usd_per_million_samples"]))
    return rows


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _finite(value: Any) -> Any:
    # JSON (and JSONB) hold no infinities: an unbounded figure is reported as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def best_server(inputs: ModelInputs, plan: Plan, candidates: Sequence[PlanNode]) -> int | None:
    """Among `candidates`, the server node of the lowest predicted $/1M samples (ties: the most
    samples/s, then the planner's order); None when no candidate can be predicted."""
    workers = _workers(inputs, plan)
    best: tuple[tuple[float, float], int] | None = None
    for node in candidates:
        if node.id not in inputs.specs:
            continue
        try:
            prediction, costs, _ = _priced(inputs, plan.strategy, workers, inputs.specs[node.id])
        except InvalidFieldError:
            continue
        usd = costs.usd_per_million_samples
        key = (math.inf if usd is None else usd, -prediction.samples_per_s)
        if best is None or key < best[0]:
            best = (key, node.id)
    return None if best is None else best[1]


def run_optimizer(inputs: ModelInputs, *, node_ids: Sequence[int], servers: Sequence[int],
                  global_batch: int, goal: str, budget_usd_per_h: float | None,
                  deadline_s: float | None, strategies: Sequence[str] | None) -> OptimizeResult:
    """`app.perfmodel.optimize.optimize` over the nodes of `inputs`; raises its `InvalidFieldError`s
    (NoPlanError for a budget or deadline nobody meets)."""
    candidates = [Candidate(inputs.specs[i], inputs.usages[i], inputs.data_caches.get(i, DataCache()))
                  for i in node_ids]
    kwargs: dict[str, Any] = {}
    if strategies:
        kwargs["strategies"] = tuple(strategies)
    if any(is_ps(s) for s in (strategies or ("ps",))):
        kwargs["servers"] = list(servers)
    return optimize(candidates, global_batch=global_batch, goal=goal, links=inputs.links, task=inputs.task,
                    prices=inputs.prices, at=inputs.at, compression=inputs.compressions,
                    budget_usd_per_h=budget_usd_per_h, deadline_s=deadline_s, max_steps=inputs.max_steps,
                    relay=True, datasets=inputs.datasets, epochs=inputs.epochs, **kwargs)


def plan_choice_public(choice: Any) -> dict[str, Any]:
    """A short JSON view of one of the optimizer's plans (no per-worker detail)."""
    p = choice.prediction
    return _finite({
        "strategy": choice.strategy, "server_node_id": choice.server_node_id,
        "node_ids": list(choice.node_ids), "batch_sizes": [n for _, n in choice.workers],
        "samples_per_s": p.samples_per_s, "step_s": p.step_s, "granularity": p.granularity,
        "time_to_max_steps_s": p.time_to_max_steps_s, "costs": choice.costs.to_dict(),
    })


def _error_pct(predicted: float | None, measured: float | None) -> float | None:
    # (predicted - measured) / measured: +10 means the model promised 10 % more than came.
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured * 100.0


def predicted_vs_measured(
    session: Session, *, run: Run, bill: Bill, links: dict[tuple[int, int], int] | None = None,
    sites: dict[int, Site] | None = None,
) -> dict | None:
    """The run's stored prediction beside what it measured: samples/s, bytes leaving their site
    per step, $/1M samples, each with the error in % of the measured; None without a prediction.
    `links` and `sites` (`run_sites_by_rank`): what the caller has read already."""
    prediction = run.prediction
    if not prediction:
        return None
    if links is None:
        links = metric_totals(session, run_id=run.id).links
    if sites is None:
        sites = run_sites_by_rank(session, run=run)
    crossing = sum(
        total for (rank, peer), total in links.items()
        if rank in sites and peer in sites and sites[rank].name != sites[peer].name
    )
    steps = bill.samples / run.global_batch_size if run.global_batch_size else 0
    measured = {
        "samples_per_s": bill.samples_per_s,
        "egress_bytes_per_step": crossing / steps if steps else None,
        "usd_per_million_samples": (
            None if bill.usd_per_million_samples is None else float(bill.usd_per_million_samples)
        ),
    }
    predicted = {
        "samples_per_s": prediction.get("samples_per_s"),
        "egress_bytes_per_step": prediction.get("egress_bytes_per_step"),
        "usd_per_million_samples": (prediction.get("costs") or {}).get("usd_per_million_samples"),
    }
    return {
        "metrics": [
            {"metric": name, "predicted": predicted[name], "measured": measured[name],
             "error_pct": _error_pct(predicted[name], measured[name])}
            for name in ("samples_per_s", "egress_bytes_per_step", "usd_per_million_samples")
        ],
        "prediction": prediction,
    }
