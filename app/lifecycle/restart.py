"""Restarting a run whose server (or an all-reduce rank) died: stop what survives, retire the
metrics token, and launch every current rank again from the latest checkpoint (rank 0 first,
the others once it has named its port), within the run's `max_restarts`."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from app.config import Settings
from app.dispatch import Order
from app.lifecycle.launch import launch_leader, orders_for
from app.lifecycle.ports import suggest_port
from app.lifecycle.states import cancel_orders, end_run, move
from app.models import Node, NodeStatus, Run, RunStatus, RunWorker, WorkerStatus
from app.queries.events import record_event
from app.run_secrets import run_metrics_token
from app.security import hash_secret
from hybridtrain.contract import is_ps

RESTART = "restart"
# Ranks of a PS run that are out of its membership: not launched again by a restart.
GONE = frozenset({WorkerStatus.failed, WorkerStatus.left, WorkerStatus.cancelled})


def _current_ranks(run: Run) -> list[RunWorker]:
    if not is_ps(run.strategy):
        return list(run.workers)  # an all-reduce world has a fixed size: every rank again
    return [w for w in run.workers if w.role == "ps" or w.status not in GONE]


def restart_or_fail(
    session: Session, *, run: Run, cause: str, settings: Settings, now: datetime
) -> list[Order]:
    """Relaunch `run` from its latest checkpoint because of `cause`, or fail it with the reason
    when its restarts are spent or a rank it needs sits on an offline node."""
    if run.restarts >= run.max_restarts:
        # A run launched without restarts fails for the cause alone, as it always did.
        spent = f"; no restart left ({run.restarts} of {run.max_restarts} used)" if run.max_restarts else ""
        return end_run(session, run=run, status=RunStatus.failed, reason=f"{cause}{spent}", now=now)
    ranks = _current_ranks(run)
    offline = [w for w in ranks if w.node_id is None
               or session.get(Node, w.node_id).status == NodeStatus.offline]
    needed = [w for w in offline if w.role == "ps" or not is_ps(run.strategy)]
    if needed:
        where = ", ".join(sorted({w.node_name for w in needed}))
        return end_run(session, run=run, status=RunStatus.failed, now=now,
                       reason=f"{cause}; cannot restart: rank(s) "
                              f"{', '.join(str(w.rank) for w in needed)} need node(s) {where}, offline")
    for worker in offline:
        worker.status = WorkerStatus.failed
        worker.finished_at = worker.finished_at or now
        worker.reason = worker.reason or f"node {worker.node_name} is offline: left out of the restart"
    ranks = [w for w in ranks if w not in offline]

    move(run, RunStatus.restarting, now=now)
    run.restarts += 1
    # The next attempt's tokens: the old ones stop being accepted (they are checked against
    # `restarts`), so a straggler of the old attempt cannot report into the new one.
    run.metrics_token_hash = hash_secret(
        run_metrics_token(settings.secret_key, run_id=run.id, attempt=run.restarts, rank=0)
    )
    # A port free on the node at launch, not the old one: the killed server's socket may
    # still hold it. Rank 0's agent confirms it or picks another.
    run.master_port = suggest_port(session, run=run, avoid=[run.master_port] if run.master_port else [])
    run.launched_at = now
    run.reason = None
    # Every role of the run on its nodes stops first (cancels go out before the launches).
    orders: list[Order] = list(cancel_orders(run, f"restarting run {run.id}: {cause}", before_attempt=run.restarts))
    for worker in ranks:
        # Held until rank 0 has started and named its port (launch.release_held).
        worker.status = WorkerStatus.planned
        worker.pid = worker.exit_code = worker.signal = None
        worker.started_at = worker.finished_at = None
        worker.reason = None
        worker.launched_at = worker.ordered_at = None
    leader = launch_leader(run, now=now)
    record_event(session, run=run, kind=RESTART, t=now,
                 detail=f"{cause}; restart {run.restarts} of {run.max_restarts}")
    session.flush()
    orders += orders_for(session, run=run, settings=settings, ranks=leader, resume=True, live=ranks)
    return orders
