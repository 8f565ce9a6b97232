"""Queries of runs: planning, creation (idempotent), reading, and the launch orders' contents.

Every change of a run's state after its creation lives in `app.lifecycle`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from app.dispatch import LaunchOrder
from app.errors import ConflictError, InvalidFieldError, NotFoundError
from app.models import Cluster, Node, NodeGpu, NodeStatus, Run, RunStatus, RunWorker, WorkerStatus
from app.planner import GpuSpec, Plan, PlanError, PlanNode, plan_run
from app.queries.bundles import get_bundle
from app.queries.common import paginate
from app.queries import predictions
from app.queries.profiles import latest_profiles
from app.schemas.runs import RunCreate
from app.run_secrets import METRICS_TOKEN_PREFIX, run_metrics_token
from app.security import hash_secret, new_secret
from hybridtrain.contract import is_ps, proportional_batch_sizes

_EPOCH = datetime.fromtimestamp(0, UTC)


# -- planning --------------------------------------------------------------------------------


def plan_node(node: Node) -> PlanNode:
    """The planner's view of a node: declared GPUs with catalog FLOPs, measured speed."""
    detected = node.detected_hardware or {}
    return PlanNode(
        id=node.id,
        name=node.name,
        site_id=node.site_id,
        site_kind=str(node.site.kind),
        provider=str(node.site.provider),
        region=node.site.region,
        continent=str(node.site.continent),
        address=node.address or detected.get("address"),
        gpus=tuple(
            GpuSpec(model=g.gpu_model.name, count=g.count, fp32_tflops=g.gpu_model.fp32_tflops)
            for g in node.gpus
        ),
        measured_samples_per_s=node.measured_samples_per_s,
        cpu_cores=detected.get("cpu_cores") if isinstance(detected.get("cpu_cores"), int) else None,
    )


def _load_nodes(session: Session, ids: Sequence[int], *, field: str) -> list[Node]:
    rows = session.scalars(
        select(Node)
        .where(Node.id.in_(ids))
        .options(selectinload(Node.gpus).joinedload(NodeGpu.gpu_model), selectinload(Node.site))
    ).all()
    by_id = {n.id: n for n in rows}
    for i, node_id in enumerate(ids):
        if node_id not in by_id:
            raise NotFoundError("node", node_id, field=f"{field}.{i}" if field == "node_ids" else field)
    return [by_id[i] for i in ids]


def _check_usable(nodes: Iterable[Node]) -> None:
    for node in nodes:
        if node.status == NodeStatus.draining:
            raise ConflictError(
                f"node {node.name} (id {node.id}) is draining: it finishes its runs and takes no "
                "new one (undrain it, or leave it out)"
            )
        if node.status != NodeStatus.online:
            raise ConflictError(
                f"node {node.name} (id {node.id}) is {node.status}: runs need online nodes "
                "(start its agent, or wait for its heartbeat)"
            )


@dataclass(frozen=True)
class TaskFacts:
    """What the nodes' finished task profiles say of a run's task (none: not profiled)."""

    ref: str
    params: int | None = None
    train_samples: int | None = None
    # node id -> samples/s of this task there, for allocation "measured".
    speeds: dict[int, float] = field(default_factory=dict)

    @property
    def profiled_nodes(self) -> list[int]:
        return sorted(self.speeds)


def task_facts(session: Session, *, data: RunCreate, node_ids: Sequence[int]) -> TaskFacts | None:
    """The newest finished profile of the run's task on each node, summed up; None for a
    script run or a task no node has profiled."""
    if data.script is not None:
        return None
    profiles = latest_profiles(session, task_key=data.task_key, node_ids=node_ids)
    if not profiles:
        return None
    known = sorted(profiles.values(), key=lambda p: (p.measured_at or _EPOCH, p.id), reverse=True)
    return TaskFacts(
        ref=data.task,
        params=next((p.params for p in known if p.params is not None), None),
        train_samples=next((p.train_samples for p in known if p.train_samples), None),
        speeds={node: p.samples_per_s for node, p in profiles.items() if p.samples_per_s},
    )


def load_plan_nodes(
    session: Session, *, node_ids: Sequence[int] | None, cluster_id: int | None
) -> list[Node]:
    """The nodes a request names (its node_ids, or its cluster's), in its order; NotFoundError
    naming the field for an unknown one, InvalidFieldError for an empty cluster."""
    if cluster_id is not None:
        cluster = session.get(Cluster, cluster_id)
        if cluster is None:
            raise NotFoundError("cluster", cluster_id, field="cluster_id")
        ids = cluster.node_ids
        if not ids:
            raise InvalidFieldError("cluster_id", f"cluster {cluster.name} has no nodes")
        return _load_nodes(session, ids, field="cluster_id")
    if not node_ids:
        raise InvalidFieldError("node_ids", "node_ids: at least one node is required")
    return _load_nodes(session, node_ids, field="node_ids")


def check_usable(nodes: Iterable[Node]) -> None:
    """ConflictError unless every node is online."""
    _check_usable(nodes)


@dataclass(frozen=True)
class Planned:
    """A plan with what the task profiles say of its task and what the model predicts of it
    (`prediction` None with `prediction_unavailable` saying why)."""

    plan: Plan
    facts: TaskFacts | None
    prediction: dict[str, Any] | None = None
    prediction_unavailable: str | None = None


def make_planned(session: Session, *, data: RunCreate) -> Planned:
    """Plan `data` over its nodes (or cluster) without storing anything, with the prediction.

    A PS run whose server is not pinned gets the server the model prefers (lowest predicted
    $/1M samples, ties to the fastest) where every node has a profile of the task; otherwise
    the planner's link weights place it.
    """
    if data.bundle_sha256 is not None:
        get_bundle(session, sha256=data.bundle_sha256, field="bundle_sha256")
    nodes = load_plan_nodes(session, node_ids=data.node_ids, cluster_id=data.cluster_id)
    ps_node = None
    if data.ps_node_id is not None:
        ps_node = _load_nodes(session, [data.ps_node_id], field="ps_node_id")[0]
    _check_usable([*nodes, *([ps_node] if ps_node else [])])
    facts = task_facts(session, data=data, node_ids=[n.id for n in nodes])
    plan_nodes = [plan_node(n) for n in nodes]

    def planned(server: PlanNode | None) -> Plan:
        try:
            return plan_run(
                strategy=data.strategy,
                global_batch_size=data.global_batch_size,
                nodes=plan_nodes,
                allocation=data.allocation,
                ps_node=server,
                task_speeds=facts.speeds if facts else None,
            )
        except PlanError as exc:
            raise InvalidFieldError(exc.field, exc.message) from exc

    plan = planned(plan_node(ps_node) if ps_node else None)
    if data.script is not None:
        return Planned(plan, facts, None, "a script run has no task profile to predict from: "
                                         "the model needs one of a task")
    inputs = predictions.model_inputs(
        session, nodes=list({n.id: n for n in [*nodes, *([ps_node] if ps_node else [])]}.values()),
        task=data.task, task_args=data.task_args, bundle_sha256=data.bundle_sha256,
        compression=data.compression, eval_every=data.eval_every,
        max_steps=data.steps(facts.train_samples if facts else None),
    )
    if isinstance(inputs, str):
        return Planned(plan, facts, None, inputs)
    if is_ps(data.strategy) and ps_node is None:
        best = predictions.best_server(inputs, plan, [n for n in plan_nodes if n.address])
        if best is not None and best != plan.ps_node_id:
            plan = planned(next(n for n in plan_nodes if n.id == best))
    try:
        return Planned(plan, facts, predictions.predict_plan(inputs, plan))
    except InvalidFieldError as exc:
        return Planned(plan, facts, None, f"the model cannot predict this plan: {exc.message}")


def make_plan(session: Session, *, data: RunCreate) -> tuple[Plan, TaskFacts | None]:
    """Plan `data` over its nodes (or cluster) without storing anything; with what the task
    profiles of its nodes say of its task."""
    planned = make_planned(session, data=data)
    return planned.plan, planned.facts


# -- creation ----------------------------------------------------------------------------------


def request_fingerprint(data: RunCreate) -> str:
    """sha256 of the request's canonical JSON: what an Idempotency-Key is bound to."""
    canonical = json.dumps(data.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def run_by_idempotency_key(session: Session, *, created_by: str, key: str) -> Run | None:
    """The run an earlier request with this key created, if any."""
    return session.scalar(
        select(Run)
        .where(Run.created_by == created_by, Run.idempotency_key == key)
        .options(selectinload(Run.workers))
    )


def check_idempotent_repeat(run: Run, *, fingerprint: str, key: str) -> Run:
    """`run` if the repeated request is the same; ConflictError if the key is reused."""
    if run.request_fingerprint != fingerprint:
        raise ConflictError(
            f"Idempotency-Key {key!r} was used for a different request (run {run.id}); "
            "use a new key for a new run"
        )
    return run


def create_run(
    session: Session,
    *,
    data: RunCreate,
    created_by: str,
    idempotency_key: str | None,
    fingerprint: str,
    secret_key: str,
) -> tuple[Run, str]:
    """Plan and store a queued run; returns it with its metrics token (its hash is stored)."""
    planned = make_planned(session, data=data)
    plan, facts = planned.plan, planned.facts
    _check_min_workers(data, plan)
    run = Run(
        name=data.name,
        status=RunStatus.queued,
        strategy=data.strategy,
        task=data.task,
        task_args=data.task_args,
        bundle_sha256=data.bundle_sha256,
        script=data.script,
        script_args=data.script_args,
        global_batch_size=data.global_batch_size,
        max_steps=data.steps(facts.train_samples if facts else None),
        epochs=data.epochs,
        target=data.target,
        stop_at_target=data.stop_at_target,
        seed=data.seed,
        allocation=plan.allocation,
        device=data.device,
        compression=data.compression.model_dump(exclude_none=True) if data.compression else {},
        rebalance_every=data.rebalance_every,
        eval_every=data.eval_every,
        cluster_id=data.cluster_id,
        ps_node_id=plan.ps_node_id,
        master_addr=plan.master_addr,
        # A placeholder until the id is known: the token is derived from it (run_metrics_token).
        metrics_token_hash=hash_secret(new_secret(METRICS_TOKEN_PREFIX)),
        created_by=created_by,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint,
        prediction=planned.prediction,
        checkpoint_every=data.checkpoint_every,
        checkpoint_every_s=data.checkpoint_every_s,
        max_restarts=data.max_restarts,
        restarts=0,
        min_workers=data.min_workers,
        min_workers_wait_s=data.min_workers_wait_s,
        priority=data.priority,
        share_gpus=data.share_gpus,
        encrypt_links=data.encrypt_links,
        workers=[
            RunWorker(
                rank=w.rank, role=w.role, node_id=w.node_id, node_name=w.node_name,
                batch_size=w.batch_size, gpu_model=w.gpu_model, gpu_index=w.gpu_index,
                speed=w.speed, speed_unit=w.speed_unit, status=WorkerStatus.planned,
            )
            for w in plan.workers
        ],
    )
    session.add(run)
    session.flush()
    token = run_metrics_token(secret_key, run_id=run.id, attempt=0, rank=0)
    # Kept for the column's uniqueness; tokens are checked by deriving them again (token_rank).
    run.metrics_token_hash = hash_secret(token)
    session.flush()
    return run, token


def _check_min_workers(data: RunCreate, plan: Plan) -> None:
    workers = sum(1 for w in plan.workers if w.role == "worker")
    if data.min_workers > workers:
        raise InvalidFieldError(
            "min_workers", f"min_workers {data.min_workers} is more than the run's {workers} worker(s)"
        )


def rank_sites(session: Session, *, run: Run) -> list[str]:
    """The site id of each rank's node, as text, in rank order (the trainer's --sites labels)."""
    node_ids = [w.node_id for w in run.workers]
    rows = session.execute(select(Node.id, Node.site_id).where(Node.id.in_(node_ids))).all()
    site_of = {node_id: site_id for node_id, site_id in rows}
    return [str(site_of.get(w.node_id, "")) for w in sorted(run.workers, key=lambda w: w.rank)]


def _trainer_options(run: Run, sites: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {"strategy": run.strategy}
    if run.script is not None:
        options["script"] = run.script
    else:
        options["task"] = run.task
        options["task-args"] = json.dumps(run.task_args or {}, sort_keys=True, separators=(",", ":"))
    options |= {
        "global-batch": run.global_batch_size,
        "seed": run.seed,
        "device": run.device,
        # Each node keeps its own copy of the metrics next to the role's log.
        "metrics-out": "metrics.jsonl",
    }
    if run.max_steps is not None:
        options["max-steps"] = run.max_steps
    elif run.epochs is not None:
        # The trainer counts the task's samples and reports the steps as `max_steps`.
        options["epochs"] = run.epochs
    if run.target is not None:
        options["target"] = run.target
    if run.stop_at_target is False:  # None on a run not yet flushed: the column's default, True
        options["no-stop-at-target"] = True
    if run.eval_every is not None:
        options["eval-every"] = run.eval_every
    if run.script is None:
        # None on a run not yet flushed: the trainer's defaults (off) apply.
        if run.checkpoint_every:
            options["checkpoint-every"] = run.checkpoint_every
        if run.checkpoint_every_s:
            options["checkpoint-every-s"] = run.checkpoint_every_s
    workers = sorted((w for w in run.workers if w.role == "worker"), key=lambda w: w.rank)
    if is_ps(run.strategy) and workers and all(w.speed for w in workers):
        # The speeds the plan split the batch with: a server that re-splits after a loss or a
        # join keeps those proportions, and a joiner says its own in the same units.
        options["speeds"] = [round(float(w.speed), 4) for w in workers]
    if is_ps(run.strategy) and run.min_workers is not None:
        options["min-workers"] = run.min_workers
        options["min-workers-wait-s"] = run.min_workers_wait_s
    if run.rebalance_every is not None:
        # The trainer's `measured` allocation starts from --batch-sizes (the plan) and
        # re-splits from observed compute times.
        options["allocation"] = "measured"
        options["rebalance-every"] = run.rebalance_every
    across = is_ps(run.strategy) and len(set(sites)) > 1 and all(sites)
    for key, value in (run.compression or {}).items():
        if key == "aggregate_at_sites":
            # Only where there are sites to aggregate at: a run within one site has none.
            if value and across:
                options["aggregate-at-sites"] = True
        elif key in ("error_feedback", "momentum_correction"):
            # The trainer's flags are --error-feedback / --no-error-feedback and the like.
            flag = key.replace("_", "-")
            options[flag if value else f"no-{flag}"] = True
        else:
            options[key.replace("_", "-")] = value
    if across:
        # The server's update then crosses to each remote site once (trainer/relay.py).
        options["sites"] = ",".join(sites)
    return options


def checkpoint_url(run: Run, public_url: str) -> str:
    """Where the run's trainer uploads its checkpoints and reads the latest one back."""
    return f"{public_url.rstrip('/')}/api/v1/runs/{run.id}/checkpoint"


def current_batch_sizes(run: Run, live: Iterable[RunWorker]) -> list[int]:
    """Every worker rank's share of the global batch (rank order), split over the `live` ones
    in proportion to their planned speeds; a rank that is gone keeps the minimum of 1 the
    trainer's command line needs, which its server never hands out."""
    alive = {w.rank for w in live}
    workers = [w for w in run.workers if w.role == "worker"]
    speeds = [(w.speed or 1.0) if w.rank in alive else 1e-9 for w in workers]
    return proportional_batch_sizes(run.global_batch_size, speeds)


def launch_orders(
    run: Run,
    *,
    metrics_token: Callable[[int], str],
    public_url: str,
    link_secret: str | None = None,
    sites: Sequence[str] = (),
    ranks: Iterable[RunWorker] | None = None,
    join: bool = False,
    resume: bool = False,
    batch_sizes: Sequence[int] | None = None,
) -> list[LaunchOrder]:
    """One launch order per rank (`ranks`, default all), carrying everything the role's command
    line needs, with the report token `metrics_token` gives its rank; `sites` (one label per rank, `rank_sites`) lets a PS run relay its update once
    per remote site; `link_secret` keys the ranks' TLS. `join` admits the ranks into the running run, `resume` starts them from
    the latest checkpoint (a restart); `batch_sizes` overrides the plan's split."""
    sizes = list(batch_sizes) if batch_sizes is not None else [
        w.batch_size for w in run.workers if w.role == "worker" and w.batch_size
    ]
    # The agent fetches the code with the run's own token, from its own server URL.
    bundle = (
        {"sha256": run.bundle_sha256, "path": f"/api/v1/runs/{run.id}/bundle"}
        if run.bundle_sha256 else None
    )
    options = _trainer_options(run, sites)
    # A script of the user's own checkpoints itself: --resume restores a task's run only.
    checkpoints = run.script is None and (bool(run.checkpoint_every) or bool(run.checkpoint_every_s) or resume)
    if resume and run.script is None:
        options["resume"] = True
    orders = []
    for worker in run.workers if ranks is None else ranks:
        assert worker.node_id is not None
        env = {}
        if worker.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(worker.gpu_index)
        spec = {
            "run_id": run.id,
            "rank": worker.rank,
            "role": worker.role,
            "world_size": len(run.workers),
            "master_addr": run.master_addr,
            "master_port": run.master_port,
            # Rank 0 listens: its agent checks the port is free there, else picks one and
            # reports it in the rank's `started` event; the other ranks are sent it after.
            "pick_port": worker.rank == 0,
            "batch_sizes": sizes,
            "report_url": f"{public_url.rstrip('/')}/api/v1/runs/{run.id}/metrics",
            "report_token": metrics_token(worker.rank),
            # Only where set: an agent that predates encrypted links still takes a plain run.
            **({"link_secret": link_secret} if link_secret else {}),
            "options": options,
            "env": env,
            "bundle": bundle,
            "script_args": list(run.script_args or []),
            "checkpoint_url": checkpoint_url(run, public_url) if checkpoints else None,
            "join": join,
            "attempt": run.restarts or 0,
        }
        orders.append(LaunchOrder(node_id=worker.node_id, run_id=run.id, rank=worker.rank, spec=spec))
    return orders


# -- reading ---------------------------------------------------------------------------------


def get_run(session: Session, *, run_id: int, lock: bool = False) -> Run:
    """The run with its workers, or NotFoundError; `lock` takes its row for an update."""
    stmt = select(Run).where(Run.id == run_id).options(selectinload(Run.workers), selectinload(Run.checkpoints))
    if lock:
        # populate_existing: a row already in the session is refreshed from the locked read.
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
    run = session.scalar(stmt)
    if run is None:
        raise NotFoundError("run", run_id)
    return run


def list_runs(
    session: Session, *, skip: int, limit: int, status: RunStatus | None = None
) -> tuple[Sequence[Run], int]:
    """A page of runs, newest first; queued runs in the queue's order (priority, then age)."""
    stmt = select(Run).options(selectinload(Run.workers), selectinload(Run.checkpoints))
    if status == RunStatus.queued:
        stmt = stmt.order_by(Run.priority.desc(), Run.id)
    else:
        stmt = stmt.order_by(Run.id.desc())
    if status is not None:
        stmt = stmt.where(Run.status == status)
    return paginate(session, stmt, skip=skip, limit=limit)
