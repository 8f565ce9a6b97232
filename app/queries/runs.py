"""Queries of runs: planning, creation (idempotent) and reading.

Every change of a run's state after its creation lives in `app.lifecycle`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from app.errors import ConflictError, InvalidFieldError, NotFoundError
from app.models import Cluster, Node, NodeGpu, NodeStatus, Run, RunStatus, RunWorker, WorkerStatus
from app.planner import GpuSpec, Plan, PlanError, PlanNode, plan_run
from app.queries.bundles import get_bundle
from app.queries.common import paginate
from app.queries import predictions
from app.queries.profiles import latest_profiles, profiled_as
from app.schemas.runs import RunCreate
from app.run_secrets import METRICS_TOKEN_PREFIX, run_metrics_token
from app.security import hash_secret, new_secret
from hybridtrain.contract import STRATEGIES, is_ps

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
class ProfileInput:
    """One node's newest finished profile of a task, as a plan's input."""

    node_id: int
    profile_id: int
    samples_per_s: float | None
    spread: float | None
    repeats: int | None
    measured_at: datetime | None
    # "profile" (the agent's profiler) or "run" (a finished run's measured steps), and which run.
    source: str = "profile"
    run_id: int | None = None


@dataclass(frozen=True)
class TaskFacts:
    """What the nodes' finished task profiles say of a run's task (none: not profiled)."""

    ref: str
    params: int | None = None
    train_samples: int | None = None
    # node id -> samples/s of this task there, for allocation "measured".
    speeds: dict[int, float] = field(default_factory=dict)
    # The profile behind each node's figures: how old and how noisy each input is.
    inputs: tuple[ProfileInput, ...] = ()

    @property
    def profiled_nodes(self) -> list[int]:
        return sorted(self.speeds)


def task_facts(session: Session, *, data: RunCreate, node_ids: Sequence[int]) -> TaskFacts | None:
    """The newest finished profile of the run's task (or script) on each node, summed up; None
    when no node has one."""
    profiles = latest_profiles(session, task_key=data.task_key, node_ids=node_ids)
    if not profiles:
        return None
    known = sorted(profiles.values(), key=lambda p: (p.measured_at or _EPOCH, p.id), reverse=True)
    return TaskFacts(
        ref=known[0].task,
        params=next((p.params for p in known if p.params is not None), None),
        train_samples=next((p.train_samples for p in known if p.train_samples), None),
        speeds={node: p.samples_per_s for node, p in profiles.items() if p.samples_per_s},
        inputs=tuple(
            ProfileInput(node, p.id, p.samples_per_s, p.spread, p.repeats, p.measured_at,
                         *_source(p))
            for node, p in sorted(profiles.items())
        ),
    )


def _source(profile: Any) -> tuple[str, int | None]:
    result = profile.result or {}
    if result.get("source") == "run":
        return "run", result.get("run_id")
    return "profile", None


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
    # Every strategy's prediction on the same nodes, best first (`predictions.compare_strategies`).
    strategies: list[dict[str, Any]] = field(default_factory=list)


def make_planned(session: Session, *, data: RunCreate, compare: bool = False) -> Planned:
    """Plan `data` over its nodes (or cluster) without storing anything, with the prediction
    and (`compare`) every strategy's beside it.

    A PS run whose server is not pinned gets the server the model prefers (lowest predicted
    $/1M samples, ties to the fastest) where every node has a profile of the task; otherwise
    the planner's link weights place it. In the comparison every PS strategy uses the plan's
    server (the planner's placement when the plan has none).
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

    def planned(server: PlanNode | None, strategy: str = data.strategy) -> Plan:
        try:
            return plan_run(
                strategy=strategy,
                global_batch_size=data.global_batch_size,
                nodes=plan_nodes,
                allocation=data.allocation,
                ps_node=server,
                task_speeds=facts.speeds if facts else None,
            )
        except PlanError as exc:
            raise InvalidFieldError(exc.field, exc.message) from exc

    plan = planned(plan_node(ps_node) if ps_node else None)
    ref, args = profiled_as(task=data.task, task_args=data.task_args, script=data.script,
                            script_args=data.script_args)
    inputs = predictions.model_inputs(
        session, nodes=list({n.id: n for n in [*nodes, *([ps_node] if ps_node else [])]}.values()),
        task=ref, task_args=args, bundle_sha256=data.bundle_sha256,
        compression=data.compression, local_sgd=data.local_sgd, eval_every=data.eval_every,
        max_steps=data.steps(facts.train_samples if facts else None),
        datasets=data.datasets or (), epochs=data.epochs,
    )
    if isinstance(inputs, str):
        return Planned(plan, facts, None, inputs)
    if is_ps(data.strategy) and ps_node is None:
        best = predictions.best_server(inputs, plan, [n for n in plan_nodes if n.address])
        if best is not None and best != plan.ps_node_id:
            plan = planned(next(n for n in plan_nodes if n.id == best))
    try:
        prediction = predictions.predict_plan(inputs, plan)
    except InvalidFieldError as exc:
        return Planned(plan, facts, None, f"the model cannot predict this plan: {exc.message}")
    if not compare:
        return Planned(plan, facts, prediction)
    pinned = [plan_node(ps_node)] if ps_node is not None else []
    server = next((n for n in [*pinned, *plan_nodes] if n.id == plan.ps_node_id), None)
    plans: dict[str, Plan] = {}
    for strategy in STRATEGIES:
        try:
            plans[strategy] = plan if strategy == plan.strategy else planned(server if is_ps(strategy) else None,
                                                                              strategy)
        except InvalidFieldError:
            continue  # a strategy this allocation or these nodes cannot plan has no row
    return Planned(plan, facts, prediction, strategies=predictions.compare_strategies(inputs, plans, plan))


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
        datasets=data.datasets or None,
        global_batch_size=data.global_batch_size,
        max_steps=data.steps(facts.train_samples if facts else None),
        epochs=data.epochs,
        target=data.target,
        stop_at_target=data.stop_at_target,
        seed=data.seed,
        allocation=plan.allocation,
        device=data.device,
        compression=data.compression.model_dump(exclude_none=True) if data.compression else {},
        local_sgd=data.local_sgd.model_dump(exclude_none=True) if data.local_sgd else {},
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
