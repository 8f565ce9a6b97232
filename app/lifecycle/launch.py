"""Launch orders: the first launch of a run, a failed one, and re-sending the orders that no
rank has answered (an agent or a broker that lost them).

An attempt launches in two steps: rank 0 first, whose agent takes a free port on its node;
once it has started and named that port, the other ranks are sent it (`release_held`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.config import Settings
from app.dispatch import CancelOrder, LaunchOrder
from app.lifecycle.states import end_run
from app.models import Run, RunStatus, RunWorker, WorkerStatus
from app.models.base import utcnow
from app.models.runs import ACTIVE_RUN_STATUSES
from app.lifecycle.orders import current_batch_sizes, launch_orders, rank_sites
from app.queries.datasets import run_dataset_access
from app.queries.runs import get_run
from app.run_secrets import run_link_secret, run_metrics_token
from hybridtrain.contract import is_ps

# States in which the run trains: a rank launched then is joining it, not starting it.
TRAINING = frozenset({RunStatus.running, RunStatus.degraded})
WAITING = frozenset({WorkerStatus.planned, WorkerStatus.launched})


def orders_for(
    session: Session,
    *,
    run: Run,
    settings: Settings,
    ranks: Sequence[RunWorker] | None = None,
    join: bool = False,
    resume: bool = False,
    live: Iterable[RunWorker] | None = None,
) -> list[LaunchOrder]:
    """Launch orders for `ranks` (default all) with their tokens of the run's current attempt;
    `live` (the ranks expected to train) re-splits the batch over them, else the plan's."""
    def token(rank: int) -> str:
        return run_metrics_token(settings.secret_key, run_id=run.id, attempt=run.restarts, rank=rank)

    # gloo (the all-reduce baselines) has no TLS: only parameter-server links are keyed.
    link_secret = (
        run_link_secret(settings.secret_key, run_id=run.id, attempt=run.restarts)
        if run.encrypt_links and is_ps(run.strategy) else None
    )
    return launch_orders(
        run, metrics_token=token, public_url=settings.public_url, link_secret=link_secret,
        sites=rank_sites(session, run=run),
        datasets=run_dataset_access(session, run=run, settings=settings),
        ranks=ranks, join=join, resume=resume,
        batch_sizes=current_batch_sizes(run, live) if live is not None else None,
        # A restart's server waits for the ranks it launches, not for a rank that is gone.
        expect_ranks=[w.rank for w in live if w.role == "worker"] if live is not None and resume else None,
    )


def launch_failed(session: Session, *, run_id: int, error: Exception) -> list[CancelOrder]:
    """Fail a run whose launch orders could not be published, with the broker's error."""
    run = get_run(session, run_id=run_id, lock=True)
    return end_run(session, run=run, status=RunStatus.failed,
                   reason=f"could not send the launch orders to the broker: {error}")


def resend_unacknowledged(
    session: Session, *, settings: Settings, now: datetime | None = None
) -> list[LaunchOrder]:
    """Launch orders again for the ranks of active runs whose order went out more than
    `launch_resend_s` ago and that have not reported their start (the agent treats a launch of
    a rank it already runs as a repeat)."""
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.launch_resend_s)
    run_ids = session.scalars(
        select(RunWorker.run_id)
        .join(Run, Run.id == RunWorker.run_id)
        .where(
            Run.status.in_(ACTIVE_RUN_STATUSES - {RunStatus.queued, RunStatus.cancelling}),
            RunWorker.status == WorkerStatus.launched,
            RunWorker.ordered_at < cutoff,
        )
        .distinct()
    ).all()
    orders: list[LaunchOrder] = []
    for run_id in run_ids:
        run = get_run(session, run_id=run_id, lock=True)
        if run.status.over:
            continue
        late = [w for w in run.workers if w.status == WorkerStatus.launched
                and w.ordered_at is not None and w.ordered_at < cutoff and w.node_id is not None]
        if not late:
            continue
        join = run.status in TRAINING
        # A first launch keeps the plan's split; a joiner or a restart gets the live ranks'.
        live = [w for w in run.workers if w.status in (*WAITING, WorkerStatus.running)]
        orders += orders_for(
            session, run=run, settings=settings, ranks=late, join=join, resume=run.restarts > 0,
            live=live if join or run.restarts else None,
        )
        for worker in late:
            worker.ordered_at = now
    session.flush()
    return orders


def launch_leader(run: Run, *, now: datetime) -> list[RunWorker]:
    """Mark an attempt's rank 0 launched and hold the others (planned) until it has named its
    port; returns [rank 0]."""
    leader = [w for w in run.workers if w.rank == 0]
    for worker in leader:
        worker.status = WorkerStatus.launched
        worker.launched_at = worker.ordered_at = now
    return leader


def release_held(session: Session, *, run: Run, settings: Settings, port: int | None,
                 now: datetime | None = None) -> list[LaunchOrder]:
    """Rank 0 has started: record the port it listens on and send the held ranks their orders.

    An agent that names no port (one that does not pick) listens on the one it was given.
    """
    if run.status.over or run.status in TRAINING:
        return []
    now = now or utcnow()
    if port is not None:
        run.master_port = port
    held = [w for w in run.workers if w.status == WorkerStatus.planned and w.node_id is not None]
    if not held:
        session.flush()
        return []
    for worker in held:
        worker.status = WorkerStatus.launched
        worker.launched_at = worker.ordered_at = now
    session.flush()
    # A restart re-splits the batch over the ranks it relaunches; a first launch keeps the plan's.
    live = [w for w in run.workers if w.status in (*WAITING, WorkerStatus.running)] if run.restarts else None
    return orders_for(session, run=run, settings=settings, ranks=held, resume=run.restarts > 0, live=live)
