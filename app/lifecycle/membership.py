"""Adding workers to a running PS run: new ranks after the highest one, launched with `join`
so that the server admits them at a step boundary with a share of the batch."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy.orm import Session

from app.config import Settings
from app.dispatch import LaunchOrder
from app.errors import ConflictError, InvalidFieldError
from app.lifecycle.launch import TRAINING, WAITING, orders_for
from app.models import Run, RunWorker, WorkerStatus
from app.models.base import utcnow
from app.models.runs import FINISHED_WORKER_STATUSES
from app.planner import PlanError, plan_run
from app.queries.events import record_event
from app.queries.runs import check_usable, get_run, load_plan_nodes, plan_node
from hybridtrain.contract import ALLREDUCE, is_ps

NODE_ADDED = "node_added"


def add_nodes(
    session: Session, *, run_id: int, node_ids: Sequence[int], settings: Settings,
    now: datetime | None = None,
) -> tuple[Run, list[LaunchOrder]]:
    """Give a training PS run one worker rank per GPU of each node; returns the join orders.

    ConflictError for an all-reduce run, a run that is not training, a node that already has
    a live rank in it or an offline node; NotFoundError (naming node_ids.i) for an unknown one.
    """
    now = now or utcnow()
    run = get_run(session, run_id=run_id, lock=True)
    if not is_ps(run.strategy):
        raise ConflictError(
            f"run {run.id} uses {run.strategy}: an all-reduce world has a fixed size; "
            "only parameter-server runs take new workers"
        )
    if run.status not in TRAINING:
        raise ConflictError(f"run {run.id} is {run.status}: workers join a running or degraded run")
    nodes = load_plan_nodes(session, node_ids=list(node_ids), cluster_id=None)
    members = {w.node_id for w in run.workers if w.status not in FINISHED_WORKER_STATUSES}
    inside = [n for n in nodes if n.id in members]
    if inside:
        raise ConflictError(
            f"node(s) {', '.join(n.name for n in inside)} already have a rank in run {run.id}"
        )
    check_usable(nodes)
    try:
        # The new slots priced the way the run's allocation prices its workers.
        slots = plan_run(strategy=ALLREDUCE, global_batch_size=run.global_batch_size,
                         nodes=[plan_node(n) for n in nodes], allocation=run.allocation).workers
    except PlanError as exc:
        raise InvalidFieldError("node_ids", f"node_ids: {exc.message}") from exc
    live = [w for w in run.workers if w.role == "worker" and (w.status in WAITING or w.status == WorkerStatus.running)]
    if len(live) + len(slots) > run.global_batch_size:
        raise InvalidFieldError(
            "node_ids", f"node_ids: the global batch of {run.global_batch_size} cannot be split over "
                        f"{len(live) + len(slots)} workers",
        )
    first = max(w.rank for w in run.workers) + 1
    added = [
        RunWorker(
            rank=first + i, role="worker", node_id=slot.node_id, node_name=slot.node_name,
            gpu_model=slot.gpu_model, gpu_index=slot.gpu_index, speed=slot.speed,
            speed_unit=slot.speed_unit, status=WorkerStatus.launched, launched_at=now, ordered_at=now,
        )
        for i, slot in enumerate(slots)
    ]
    run.workers.extend(added)
    session.flush()
    orders = orders_for(session, run=run, settings=settings, ranks=added, join=True, live=live + added)
    sizes = orders[0].spec["batch_sizes"] if orders else []
    workers = [w for w in run.workers if w.role == "worker"]
    for worker, size in zip(workers, sizes, strict=True):
        if worker in added:
            worker.batch_size = size
    for worker in added:
        record_event(session, run=run, kind=NODE_ADDED, subject=worker.rank, node_id=worker.node_id,
                     detail=f"rank {worker.rank} on node {worker.node_name} joins with a batch of "
                            f"{worker.batch_size}", t=now)
    session.flush()
    return run, orders
