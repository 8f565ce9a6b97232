"""The periodic liveness pass: silent nodes go offline and their ranks are lost, launches that
never started fail, unanswered launch orders are sent again, the workers still running
after their run succeeded are stopped, and queued runs whose GPUs are free start."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.capacity import RETRY_AFTER_S
from app.config import Settings
from app.dispatch import Order
from app.lifecycle.launch import TRAINING, WAITING, resend_unacknowledged
from app.lifecycle.roles import rank_lost
from app.lifecycle.schedule import start_queued
from app.lifecycle.states import cancel_orders, end_run, settle_cancel
from app.models import Node, NodeStatus, Run, RunStatus, RunWorker, WorkerStatus
from app.models.base import utcnow
from app.models.runs import ACTIVE_RUN_STATUSES, FINISHED_WORKER_STATUSES
from app.queries.events import record_event
from app.queries.final_bills import store_final_bills
from app.queries.runs import get_run

log = logging.getLogger(__name__)

# The run event of a rank whose end its agent never reported after a cancel.
CANCEL_TIMEOUT = "cancel_timeout"
# How often agents are asked to beat (`heartbeat_interval_s` of their registration): six beats
# inside the heartbeat timeout.
BEATS_PER_TIMEOUT = 6


def heartbeat_interval_s(settings: Settings) -> float:
    """How often an agent is asked to beat."""
    return settings.heartbeat_timeout_s / BEATS_PER_TIMEOUT


def offline_after_s(settings: Settings) -> float:
    """How long a node may be silent before the pass takes it offline: `heartbeat_timeout_s`,
    and never less than a beat shed by a full heartbeat lane (app/capacity.py) can silence a
    live node: the beat waits in the lane's queue and is refused, its agent sends it again
    after Retry-After (stretched by up to half) and that one waits too, or an agent that does
    not retry sends its next beat an interval later."""
    interval = heartbeat_interval_s(settings)
    shed = 2 * settings.admission_wait_s + 1.5 * RETRY_AFTER_S
    return max(settings.heartbeat_timeout_s, 2 * interval + shed)


def check_liveness(session: Session, *, settings: Settings, now: datetime | None = None) -> list[Order]:
    """One pass; returns the orders to send after commit.

    1. Online nodes silent for `offline_after_s` go offline; each unfinished rank of an
       active run on them is lost (a PS worker: the run is degraded; a server: it restarts).
    2. Runs launching (or restarting) for `launch_timeout_s` with ranks that never started
       fail, naming them; a worker that never joined a training run is lost instead.
    3. Launch orders unanswered for `launch_resend_s` are sent again.
    4. Ranks still running `finish_grace_s` after their run succeeded are stopped.
    5. Runs `cancelling` for `cancel_timeout_s` end `cancelled`; the online nodes of the
       ranks whose end was never reported are drained, said in the run's events.
    6. Queued runs whose GPUs are free start (a safety net: ending a run starts them at once).
    """
    now = now or utcnow()
    orders: list[Order] = []
    orders += _silent_nodes(session, settings=settings, now=now)
    orders += _late_launches(session, settings=settings, now=now)
    orders += resend_unacknowledged(session, settings=settings, now=now)
    orders += cancel_stragglers(session, grace_s=settings.finish_grace_s, now=now)
    cancel_timeouts(session, timeout_s=settings.cancel_timeout_s, now=now)
    orders += start_queued(session, settings=settings, now=now)
    session.flush()
    return orders


def _silent_nodes(session: Session, *, settings: Settings, now: datetime) -> list[Order]:
    timeout = offline_after_s(settings)
    stale = session.scalars(
        select(Node)
        .where(Node.status == NodeStatus.online, Node.last_heartbeat < now - timedelta(seconds=timeout))
        .with_for_update(skip_locked=True)
    ).all()
    for node in stale:
        log.warning("node %s (id %s) missed heartbeats since %s: offline", node.name, node.id, node.last_heartbeat)
        node.status = NodeStatus.offline
    session.flush()
    affected = session.scalars(
        select(Run.id)
        .join(RunWorker, RunWorker.run_id == Run.id)
        .join(Node, Node.id == RunWorker.node_id)
        .where(
            # A queued run has launched nothing: it waits for the node (app.lifecycle.schedule).
            Run.status.in_(ACTIVE_RUN_STATUSES - {RunStatus.queued}),
            Node.status == NodeStatus.offline,
            RunWorker.status.not_in(FINISHED_WORKER_STATUSES),
        )
        .distinct()
    ).all()
    orders: list[Order] = []
    for run_id in affected:
        run = get_run(session, run_id=run_id, lock=True)
        offline = {w.node_id for w in run.workers if w.node_id is not None
                   and session.get(Node, w.node_id).status == NodeStatus.offline}
        for worker in [w for w in run.workers if w.node_id in offline]:
            if run.status.finished or worker.status in FINISHED_WORKER_STATUSES:
                continue
            node = session.get(Node, worker.node_id)
            seen = node.last_heartbeat.isoformat(timespec="seconds") if node.last_heartbeat else "never"
            reason = (f"node {node.name} went offline: no heartbeat for {timeout:.0f} s "
                      f"(last {seen}); rank {worker.rank} ({worker.role}) lost")
            orders += rank_lost(session, run=run, worker=worker, reason=reason, settings=settings, now=now)
    # A silent node cannot take its cancel order; it learns from its next heartbeat.
    offline_ids = _offline_ids(session)
    return [o for o in orders if o.node_id not in offline_ids]


def _offline_ids(session: Session) -> set[int]:
    return set(session.scalars(select(Node.id).where(Node.status == NodeStatus.offline)).all())


def _late_launches(session: Session, *, settings: Settings, now: datetime) -> list[Order]:
    timeout = settings.launch_timeout_s
    cutoff = now - timedelta(seconds=timeout)
    candidates = session.scalars(
        select(Run.id).join(RunWorker, RunWorker.run_id == Run.id).where(
            Run.status.in_(ACTIVE_RUN_STATUSES - {RunStatus.queued, RunStatus.cancelling}),
            RunWorker.status.in_(WAITING),
            Run.launched_at < cutoff,
        ).distinct()
    ).all()
    orders: list[Order] = []
    for run_id in candidates:
        run = get_run(session, run_id=run_id, lock=True)
        if run.status in TRAINING:
            for worker in run.workers:
                if worker.status in WAITING and worker.launched_at is not None and worker.launched_at < cutoff:
                    reason = (f"rank {worker.rank} (worker) did not join within {timeout:.0f} s "
                              f"(on {worker.node_name})")
                    orders += rank_lost(session, run=run, worker=worker, reason=reason, settings=settings,
                                        now=now, rejoins=False)
            continue
        if run.status.over or run.launched_at is None or run.launched_at >= cutoff:
            continue
        waiting = [w for w in run.workers if w.status in WAITING]
        if not waiting:
            continue
        reason = "rank(s) {} did not start within {:.0f} s (on {})".format(
            ", ".join(str(w.rank) for w in waiting), timeout,
            ", ".join(sorted({w.node_name for w in waiting})),
        )
        orders += end_run(session, run=run, status=RunStatus.failed, reason=reason, now=now)
    return orders


def cancel_timeouts(session: Session, *, timeout_s: float, now: datetime | None = None) -> list[int]:
    """End the runs `cancelling` for `timeout_s` as `cancelled`; returns their ids.

    A rank whose end no agent reported by then counts as gone, and its node, if online, is
    drained: its processes may still hold the GPU, so it takes no run until someone checks
    it and undrains it (`hybridtrain nodes undrain`). An offline node takes none anyway.
    """
    now = now or utcnow()
    run_ids = session.scalars(
        select(Run.id).where(Run.status == RunStatus.cancelling,
                             Run.cancel_requested_at < now - timedelta(seconds=timeout_s))
    ).all()
    for run_id in run_ids:
        run = get_run(session, run_id=run_id, lock=True)
        if run.status != RunStatus.cancelling:
            continue
        for worker in run.workers:
            if worker.status in FINISHED_WORKER_STATUSES:
                continue
            node = session.get(Node, worker.node_id) if worker.node_id is not None else None
            drained = node is not None and node.status == NodeStatus.online
            if drained:
                node.status = NodeStatus.draining
            where = node.name if node is not None else worker.node_name
            detail = (f"node {where} did not report rank {worker.rank} ({worker.role}) gone within "
                      f"{timeout_s:.0f} s of the cancel"
                      + ("; the node is drained until someone checks it for leftover processes "
                         f"and undrains it (hybridtrain nodes undrain {node.id})" if drained and node else ""))
            log.warning("run %s: %s", run.id, detail)
            worker.status = WorkerStatus.cancelled
            worker.finished_at = now
            worker.reason = worker.reason or detail
            record_event(session, run=run, kind=CANCEL_TIMEOUT, subject=worker.rank, node_id=worker.node_id,
                         detail=detail, t=now)
        settle_cancel(session, run=run, now=now)
    return list(run_ids)


def cancel_stragglers(session: Session, *, grace_s: float, now: datetime | None = None) -> list[Order]:
    """Stop the ranks still running `grace_s` after their run succeeded (a PS run ends with its
    server; its workers normally follow within a step)."""
    now = now or utcnow()
    runs = session.scalars(
        select(Run.id).join(RunWorker, RunWorker.run_id == Run.id).where(
            Run.status == RunStatus.succeeded,
            Run.finished_at < now - timedelta(seconds=grace_s),
            RunWorker.status.not_in(FINISHED_WORKER_STATUSES),
        ).distinct()
    ).all()
    orders: list[Order] = []
    for run_id in runs:
        run = get_run(session, run_id=run_id, lock=True)
        late = [w for w in run.workers if w.status not in FINISHED_WORKER_STATUSES]
        for worker in late:
            worker.status = WorkerStatus.cancelled
            worker.finished_at = now
            worker.reason = f"still running {grace_s:.0f} s after the run succeeded"
        quiet = {w.node_id for w in run.workers} - {w.node_id for w in late}
        orders += cancel_orders(run, f"run {run.id} succeeded", skip_nodes=[n for n in quiet if n is not None])
        session.flush()
        store_final_bills(session, [run], now=now)
    return orders
