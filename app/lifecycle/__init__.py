"""A run's life in one place: its states and the moves between them (`states`), the lock that
guards them (`lock`), the orders they produce (`launch`, `restart`, `membership`, `rejoin`),
the queue for GPUs (`schedule`) and rank 0's port (`ports`), what a rank's start, exit or loss
does (`roles`) and the periodic liveness pass (`liveness`).

The API routes, the pages, the agents' events and heartbeats and the monitor call these
functions inside one transaction under `run_state_lock`, commit, and only then send the
orders they return.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.dispatch import CancelOrder
from app.errors import ConflictError
from app.lifecycle.launch import launch_failed, orders_for, release_held, resend_unacknowledged
from app.lifecycle.liveness import cancel_stragglers, check_liveness
from app.lifecycle.lock import run_state_lock
from app.lifecycle.membership import add_nodes
from app.lifecycle.rejoin import rejoin_node
from app.lifecycle.roles import Exit, rank_exited, rank_lost, rank_started
from app.lifecycle.schedule import QueueView, queue_view, start_queued
from app.lifecycle.states import TRANSITIONS, IllegalTransition, begin_cancel, can_move, end_run, move, settle_cancel
from app.models import Run, RunStatus
from app.queries.runs import get_run

__all__ = [
    "TRANSITIONS",
    "Exit",
    "QueueView",
    "IllegalTransition",
    "add_nodes",
    "begin_cancel",
    "can_move",
    "cancel_run",
    "cancel_stragglers",
    "check_liveness",
    "end_run",
    "launch_failed",
    "move",
    "orders_for",
    "queue_view",
    "rank_exited",
    "rank_lost",
    "rank_started",
    "rejoin_node",
    "release_held",
    "resend_unacknowledged",
    "run_state_lock",
    "settle_cancel",
    "start_queued",
]


def cancel_run(session: Session, *, run_id: int, reason: str) -> tuple[Run, list[CancelOrder]]:
    """Cancel an active run (`states.begin_cancel`); ConflictError if it has already ended or
    is being cancelled."""
    run = get_run(session, run_id=run_id, lock=True)
    if run.status.finished:
        raise ConflictError(f"run {run.id} has already ended ({run.status}); nothing to cancel")
    if run.status == RunStatus.cancelling:
        raise ConflictError(f"run {run.id} is already being cancelled: its agents are stopping its roles")
    return run, begin_cancel(session, run=run, reason=reason)
