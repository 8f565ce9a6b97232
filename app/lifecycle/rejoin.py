"""A PS worker lost to something outside its own code joins its run again from the same node.

Killed by a signal (the kernel's OOM killer, a kill -9), stopped because its agent restarted,
or lost with its node that later came back: the node gets a new rank in the run, launched with
`join`, which the server admits at a step boundary with the current model (as
`POST /runs/{id}/nodes` does). A worker that exited with an error of its own is not sent back:
the same code would fail the same way. Each node rejoins a run at most `max_restarts` times,
so a worker the OOM killer takes on every attempt does not loop for ever.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.config import Settings
from app.dispatch import Order
from app.errors import ConflictError, InvalidFieldError, NotFoundError
from app.lifecycle.launch import TRAINING
from app.lifecycle.membership import add_nodes
from app.models import Node, NodeStatus, Run, RunWorker, WorkerStatus
from app.models.events import RunEvent
from app.queries.events import record_event
from hybridtrain.contract import is_ps

log = logging.getLogger(__name__)

REJOINED = "node_rejoined"


def rejoins_used(session: Session, *, run: Run, node_id: int) -> int:
    """How often `node_id` has rejoined `run` so far."""
    return session.scalar(
        select(func.count()).select_from(RunEvent)
        .where(RunEvent.run_id == run.id, RunEvent.kind == REJOINED, RunEvent.node_id == node_id)
    ) or 0


def rejoin(session: Session, *, run: Run, lost: RunWorker, settings: Settings, now: datetime) -> list[Order]:
    """The join orders that bring `lost`'s node back into `run`, or none where it cannot
    rejoin: not a PS worker, a run not training, a node offline or draining, a node with a
    live rank in the run still, or its rejoins spent."""
    if (not is_ps(run.strategy) or lost.role != "worker" or run.status not in TRAINING or lost.node_id is None
            or not rejoinable(lost)):
        return []
    node = session.get(Node, lost.node_id)
    if node is None or node.status != NodeStatus.online:
        return []
    used = rejoins_used(session, run=run, node_id=node.id)
    if used >= run.max_restarts:
        return []
    try:
        _, orders = add_nodes(session, run_id=run.id, node_ids=[node.id], settings=settings, now=now)
    except (ConflictError, InvalidFieldError, NotFoundError) as exc:
        log.info("run %s: node %s does not rejoin: %s", run.id, node.name, exc)
        return []
    ranks = ", ".join(str(o.rank) for o in orders)
    record_event(session, run=run, kind=REJOINED, subject=lost.rank, node_id=node.id, t=now,
                 detail=f"rank {lost.rank} on node {node.name} was lost ({lost.reason}); the node "
                        f"rejoins as rank {ranks} ({used + 1} of {run.max_restarts})")
    return orders


def rejoin_node(session: Session, *, node: Node, settings: Settings, now: datetime) -> list[Order]:
    """A node back online: each training PS run that lost a worker of it while it was away
    takes it back."""
    lost = session.scalars(
        select(RunWorker).join(Run, Run.id == RunWorker.run_id)
        .where(RunWorker.node_id == node.id, RunWorker.role == "worker",
               RunWorker.status == WorkerStatus.failed, RunWorker.exit_code.is_(None),
               Run.status.in_(TRAINING))
        .order_by(RunWorker.run_id, RunWorker.rank.desc())
    ).all()
    orders: list[Order] = []
    done: set[int] = set()
    for worker in lost:
        if worker.run_id in done or not rejoinable(worker):
            continue
        done.add(worker.run_id)
        orders += rejoin(session, run=worker.run, lost=worker, settings=settings, now=now)
    return orders


def rejoinable(worker: RunWorker) -> bool:
    """Whether a failed worker was lost to something outside its code after it had started:
    killed by a signal, or gone without an exit report (its node silent, its agent restarted)."""
    return (worker.status == WorkerStatus.failed and worker.started_at is not None
            and (bool(worker.signal) or worker.exit_code is None))
