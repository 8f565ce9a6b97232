"""Runs: plan, launch (idempotently), read, list, cancel and add nodes to."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, HTTPException, Query, Response, status
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.api.deps import (
    CiDep, DispatcherDep, IdPath, PaginationDep, Principal, ReadDep, SessionDep, SettingsDep,
)
from app.api.responses import CONFLICT, NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app import lifecycle
from app.config import Settings
from app.dispatch import Dispatcher, LaunchOrder
from app.models import Node, Run, RunStatus
from app.queries import profiles as profile_queries
from app.queries import profiling as profiling_queries
from app.queries import runs as queries
from app.queries.bundles import get_bundle
from app.queries.datasets import check_run_datasets, predict_reads, run_warmup
from app.schemas.common import Page
from app.schemas.predictions import PlanRequest, PlanSetPublic, PlanWithPrediction
from app.schemas.runs import DataWarmupPublic, PlanTaskPublic, RunAddNodes, RunCancel, RunCreate, RunPublic
from app.token_limits import refusal
from hybridtrain.contract import STRATEGIES, is_ps
from hybridtrain.train_options import sections_for

log = logging.getLogger(__name__)

router = APIRouter()

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
        description="a repeat of the same request with the same key returns the same run",
    ),
]


@router.post("/plan", response_model=PlanWithPrediction | PlanSetPublic, responses=NOT_FOUND_OR_CONFLICT)
def plan_run(
    session: SessionDep, principal: CiDep, dispatcher: DispatcherDep, body: PlanRequest
) -> PlanWithPrediction | PlanSetPublic:
    """Preview the plan of a run (ranks, server, batch sizes) and its predicted throughput and
    cost without launching it; "strategies": "all" plans every strategy side by side;
    "profile_missing" orders the task's profile from the nodes that have none."""
    data = RunCreate.model_validate(body.model_dump(exclude={"strategies", "profile_missing"}))
    profiling: list[dict] = []
    if body.profile_missing and data.script is None:
        nodes = queries.load_plan_nodes(session, node_ids=data.node_ids, cluster_id=data.cluster_id)
        if data.ps_node_id is not None and data.ps_node_id not in {n.id for n in nodes}:
            # A pinned server's node is one of the model's inputs too.
            nodes += queries.load_plan_nodes(session, node_ids=[data.ps_node_id], cluster_id=None)
        queries.check_usable(nodes)  # nothing is ordered for a plan that is refused
        profiling = order_profiles_for_plan(
            session, dispatcher, principal, nodes=nodes, task=data.task, task_args=data.task_args,
            bundle_sha256=data.bundle_sha256, device=data.device,
        )
    if body.strategies == "all":
        plans = [queries.make_planned(session, data=variant) for variant in strategy_variants(data)]
        return PlanSetPublic(plans=[
            plan_public(data, planned, profiling=profiling, data_reads=predicted_reads(session, data, planned))
            for planned in plans
        ])
    planned = queries.make_planned(session, data=data, compare=True)
    return plan_public(data, planned, profiling=profiling, data_reads=predicted_reads(session, data, planned))


def predicted_reads(session: Session, data: RunCreate, planned: queries.Planned) -> list[dict]:
    """What the plan's workers fetch of the run's data sets from their stores over the run, priced."""
    if not data.datasets:
        return []
    facts = planned.facts
    return predict_reads(session, names=data.datasets,
                         node_ids=[w.node_id for w in planned.plan.workers if w.role == "worker"],
                         global_batch=data.global_batch_size,
                         max_steps=data.steps(facts.train_samples if facts else None), epochs=data.epochs)


def order_profiles_for_plan(
    session: Session, dispatcher: Dispatcher, principal: Principal, *, nodes: Sequence[Node], task: str,
    task_args: dict[str, Any], bundle_sha256: str | None, device: str,
) -> list[dict[str, Any]]:
    """Order the task's profile from the nodes that lack one (committed, then sent, as POST
    /tasks/profiles does); every node the plan waits on, as `ProfilingPublic` dicts."""
    if principal.actions is not None:
        why = refusal(principal.name, principal.actions, "profiles:write")
        if why is not None:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"profile_missing: {why}")
    if bundle_sha256 is not None:
        get_bundle(session, sha256=bundle_sha256, field="bundle_sha256")
    ordered, waiting = profiling_queries.order_missing_profiles(
        session, nodes=nodes, task=task, task_args=task_args, bundle_sha256=bundle_sha256,
        device=device, created_by=principal.name,
    )
    if ordered:
        session.commit()
        try:
            dispatcher.send(profile_queries.profile_orders(ordered))
        except Exception as exc:  # noqa: BLE001 - any broker failure fails the profiles, with its cause
            log.error("could not send profile orders: %s", exc)
            profile_queries.fail_profiles(
                session, profiles=ordered, error=f"could not send the profile order to the broker: {exc}"
            )
            session.commit()
    now = datetime.now(UTC)
    return [w.public(now) for w in waiting]


def strategy_variants(data: RunCreate) -> list[RunCreate]:
    """`data` once per strategy, without the options another kind of strategy refuses (a pinned
    server, re-balancing, pipelined chunks are PS-only; an allocation applies as given)."""
    variants = []
    for strategy in STRATEGIES:
        update: dict = {"strategy": strategy}
        if not is_ps(strategy):
            update["ps_node_id"] = None
        update |= sections_for(strategy, compression=data.compression, local_sgd=data.local_sgd,
                               rebalance_every=data.rebalance_every)
        variants.append(data.model_copy(update=update))
    return variants


def plan_public(data: RunCreate, planned: queries.Planned, *, profiling: list[dict] | None = None,
                data_reads: list[dict] | None = None) -> PlanWithPrediction:
    """The API's view of a plan, with its prediction, the profiles it rests on (their age and
    spread) and those it waits on."""
    plan, facts = planned.plan, planned.facts
    now = datetime.now(UTC)
    names = {w.node_id: w.node_name for w in plan.workers}
    inputs = [
        {"node_id": i.node_id, "node_name": names.get(i.node_id), "profile_id": i.profile_id,
         "samples_per_s": i.samples_per_s, "spread": i.spread, "repeats": i.repeats, "measured_at": i.measured_at,
         "source": i.source, "run_id": i.run_id,
         "age_s": None if i.measured_at is None else max(0.0, (now - _aware(i.measured_at)).total_seconds())}
        for i in (facts.inputs if facts else ())
    ]
    return PlanWithPrediction(
        strategy=plan.strategy, allocation=plan.allocation,
        global_batch_size=plan.global_batch_size,
        max_steps=data.steps(facts.train_samples if facts else None),
        world_size=plan.world_size, ps_node_id=plan.ps_node_id, master_addr=plan.master_addr,
        workers=[w.__dict__ for w in plan.workers],
        task=PlanTaskPublic(
            ref=facts.ref, params=facts.params, train_samples=facts.train_samples,
            profiled_nodes=facts.profiled_nodes,
        ) if facts else None,
        prediction=planned.prediction,
        strategies=planned.strategies,
        data_reads=data_reads or [],
        prediction_unavailable=planned.prediction_unavailable,
        profiling=profiling or [],
        inputs=inputs,
    )


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


@router.post(
    "",
    response_model=RunPublic,
    status_code=status.HTTP_201_CREATED,
    responses={**NOT_FOUND_OR_CONFLICT, 200: {"model": RunPublic, "description": "A repeat (same Idempotency-Key): the run it created"}},
)
def create_run(
    session: SessionDep,
    principal: CiDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    body: RunCreate,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> RunPublic:
    """Plan a run, store it, and send each rank's launch order to its node's agent, or queue it
    while another run holds a GPU it needs."""
    fingerprint = queries.request_fingerprint(body)
    if idempotency_key is not None:
        earlier = queries.run_by_idempotency_key(session, created_by=principal.name, key=idempotency_key)
        if earlier is not None:
            response.status_code = status.HTTP_200_OK
            return RunPublic.model_validate(
                queries.check_idempotent_repeat(earlier, fingerprint=fingerprint, key=idempotency_key)
            )
    check_run_datasets(session, names=body.datasets or [], settings=settings)
    run, _ = queries.create_run(
        session, data=body, created_by=principal.name,
        idempotency_key=idempotency_key, fingerprint=fingerprint, secret_key=settings.secret_key,
    )
    try:
        session.commit()
    except IntegrityError:
        # A concurrent request with the same key won the race: answer with its run.
        session.rollback()
        earlier = queries.run_by_idempotency_key(session, created_by=principal.name, key=idempotency_key or "")
        if earlier is None:
            raise
        response.status_code = status.HTTP_200_OK
        return RunPublic.model_validate(
            queries.check_idempotent_repeat(earlier, fingerprint=fingerprint, key=idempotency_key or "")
        )

    # Orders go out only after the run is committed, so an agent's first report finds it; the
    # run starts now if its GPUs are free, else it waits in the queue.
    with lifecycle.run_state_lock(settings.is_sqlite):
        orders = lifecycle.start_queued(session, settings=settings)
        session.commit()
    send_launches(session, settings=settings, dispatcher=dispatcher, orders=orders)
    return run_public(session, queries.get_run(session, run_id=run.id))


def send_launches(
    session: Session, *, settings: Settings, dispatcher: Dispatcher, orders: list[LaunchOrder]
) -> None:
    """Send each started run's launch orders; a run whose orders the broker refuses fails with
    its error (the others are sent on)."""
    by_run: dict[int, list[LaunchOrder]] = {}
    for order in orders:
        by_run.setdefault(order.run_id, []).append(order)
    for run_id, run_orders in by_run.items():
        try:
            dispatcher.send(run_orders)
        except Exception as exc:  # noqa: BLE001 - any broker failure fails the run, with its cause
            log.error("run %s: could not send launch orders: %s", run_id, exc)
            with lifecycle.run_state_lock(settings.is_sqlite):
                cancels = lifecycle.launch_failed(session, run_id=run_id, error=exc)
                session.commit()
            dispatcher.send_quietly(cancels)


def run_public(session: Session, run: Run, queue: lifecycle.QueueView | None = None) -> RunPublic:
    """The API's view of a run; a queued one with its place in the queue and why it waits."""
    public = RunPublic.model_validate(run)
    if run.status != RunStatus.queued:
        return public
    view = queue if queue is not None else lifecycle.queue_view(session)
    return public.model_copy(update={
        "queue_position": view.position.get(run.id), "waiting_for": view.waiting_for.get(run.id, []),
    })


@router.get("", response_model=Page[RunPublic])
def read_runs(
    session: SessionDep,
    _: ReadDep,
    page: PaginationDep,
    status: Annotated[RunStatus | None, Query()] = None,
) -> Page[RunPublic]:
    """List runs, newest first, optionally by status; `status=queued` lists the queue in order."""
    rows, count = queries.list_runs(session, skip=page.skip, limit=page.limit, status=status)
    queue = lifecycle.queue_view(session) if any(r.status == RunStatus.queued for r in rows) else None
    return Page(data=[run_public(session, r, queue) for r in rows], count=count)


@router.get("/{run_id}", response_model=RunPublic, responses=NOT_FOUND)
def read_run(session: SessionDep, _: ReadDep, run_id: IdPath) -> RunPublic:
    """Show a run with its plan and where each rank stands (queued: its place in the queue; one
    reading data sets from a store: how far its first epoch warmed the caches)."""
    run = queries.get_run(session, run_id=run_id)
    public = run_public(session, run)
    warmup = run_warmup(session, run=run)
    if warmup is None:
        return public
    return public.model_copy(update={"data_warmup": [DataWarmupPublic.model_validate(w) for w in warmup]})


@router.post("/{run_id}/cancel", response_model=RunPublic, responses={**NOT_FOUND, **CONFLICT})
def cancel_run(
    session: SessionDep,
    principal: CiDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    run_id: IdPath,
    body: Annotated[RunCancel | None, Body()] = None,
) -> RunPublic:
    """Cancel an active run: its roles are stopped on every node. A launched run reads
    `cancelling` until its agents report them gone, then `cancelled`."""
    reason = (body.reason if body else None) or f"cancelled by {principal.name}"
    with lifecycle.run_state_lock(settings.is_sqlite):
        run, cancels = lifecycle.cancel_run(session, run_id=run_id, reason=reason)
        # A queued run's claim on its GPUs is gone: the runs behind it may start. A launched
        # run holds its GPUs until its agents report its roles gone.
        launches = lifecycle.start_queued(session, settings=settings)
        session.commit()
    dispatcher.send_quietly(cancels)
    dispatcher.send_quietly(launches)
    return RunPublic.model_validate(run)


@router.post("/{run_id}/nodes", response_model=RunPublic, responses={**NOT_FOUND, **CONFLICT})
def add_run_nodes(
    session: SessionDep,
    _: CiDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    run_id: IdPath,
    body: RunAddNodes,
) -> RunPublic:
    """Add workers to a running parameter-server run: one rank per GPU of each node, admitted
    by the server at a step boundary with a share of the batch."""
    with lifecycle.run_state_lock(settings.is_sqlite):
        run, orders = lifecycle.add_nodes(session, run_id=run_id, node_ids=body.node_ids, settings=settings)
        session.commit()
    # A lost join order is sent again by the liveness pass (launch_resend_s).
    dispatcher.send_quietly(orders)
    return RunPublic.model_validate(queries.get_run(session, run_id=run_id))
