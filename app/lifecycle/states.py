"""A run's states, the moves allowed between them, and ending a run.

    queued ─► launching ─► running ◄─► degraded
       │          │           │            │
       └──────────┴─────┬─────┴────────────┘
                        ▼
                   restarting ─► running | degraded | restarting (another attempt)
    every active state ─► succeeded | failed | cancelled   (final: no move out)
    launching | running | degraded | restarting ─► cancelling ─► cancelled

`queued` may skip `launching` (a fast agent reports its start before the launch is recorded);
`restarting` never goes back to `launching`: its ranks' starts bring it to `running`.
A cancelled queued run has nothing to stop and is `cancelled` at once; a launched one is
`cancelling`, its GPUs still held, until its agents report every rank gone (`settle_cancel`)
or the liveness pass gives up on them (`cancel_timeout_s`).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy.orm import Session

from app.dispatch import CancelOrder
from app.errors import ConflictError
from app.models import Run, RunStatus, WorkerStatus
from app.models.base import utcnow
from app.models.runs import FINISHED_RUN_STATUSES, FINISHED_WORKER_STATUSES
from app.queries.final_bills import store_final_bills
from app.queries.run_profiles import refresh_profiles

Q, L, R, D, S, C = (RunStatus.queued, RunStatus.launching, RunStatus.running, RunStatus.degraded,
                    RunStatus.restarting, RunStatus.cancelling)
_ENDS = FINISHED_RUN_STATUSES

TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    Q: frozenset({L, R, D, S, *_ENDS}),
    L: frozenset({R, D, S, C, *_ENDS}),
    R: frozenset({D, S, C, *_ENDS}),
    D: frozenset({R, S, C, *_ENDS}),
    S: frozenset({R, D, S, C, *_ENDS}),
    C: frozenset({RunStatus.cancelled}),
    **{end: frozenset() for end in _ENDS},
}


class IllegalTransition(ConflictError):
    """A run cannot move from its state to the one asked for (answered 409)."""

    def __init__(self, run: Run, to: RunStatus) -> None:
        super().__init__(f"run {run.id} cannot go from {run.status} to {to}")
        self.run_id = run.id
        self.from_status = run.status
        self.to_status = to


def can_move(current: RunStatus, to: RunStatus) -> bool:
    """Whether the table allows `current` -> `to`."""
    return to in TRANSITIONS[current]


def move(run: Run, to: RunStatus, *, now: datetime | None = None) -> None:
    """Put `run` in state `to`; IllegalTransition when the table forbids it."""
    if not can_move(run.status, to):
        raise IllegalTransition(run, to)
    now = now or utcnow()
    if to == L:
        run.launched_at = now
    if to == R and run.started_at is None:
        run.started_at = now
    if to in _ENDS:
        run.finished_at = now
    run.status = to


def cancel_orders(run: Run, reason: str, *, skip_nodes: Iterable[int] = (),
                  before_attempt: int | None = None) -> list[CancelOrder]:
    """A cancel order for every node with a rank of `run` (except `skip_nodes`); with
    `before_attempt`, of the roles of earlier attempts only."""
    skip = set(skip_nodes)
    nodes = sorted({w.node_id for w in run.workers if w.node_id is not None} - skip)
    return [CancelOrder(node_id=n, run_id=run.id, reason=reason, before_attempt=before_attempt) for n in nodes]


def end_run(
    session: Session,
    *,
    run: Run,
    status: RunStatus,
    reason: str | None,
    now: datetime | None = None,
    skip_nodes: Iterable[int] = (),
) -> list[CancelOrder]:
    """End an active run (a finished one is left as it is: the first end wins) and return the
    cancel orders for its nodes.

    A failed or cancelled run's unfinished ranks become cancelled at once. A succeeded run's
    ranks still running are left to end by themselves: a PS run's workers leave after their
    server's goodbye, and `cancel_stragglers` stops the ones still there after a grace. The
    run's final bill is stored once its last rank has ended (`store_final_bills`).
    """
    if run.status.finished or (run.status == C and status != RunStatus.cancelled):
        # A cancel under way decides how the run ends.
        return []
    # A queued run has sent no order: there is nothing on its nodes to stop.
    launched = run.status != RunStatus.queued
    now = now or utcnow()
    move(run, status, now=now)
    run.reason = reason
    if status == RunStatus.succeeded:
        session.flush()
        # Its measured steps refresh its nodes' profiles; the workers that end after it add theirs
        # (app.lifecycle.roles.rank_exited).
        refresh_profiles(session, run=run, now=now)
        store_final_bills(session, [run], now=now)
        return []
    for worker in run.workers:
        if worker.status not in FINISHED_WORKER_STATUSES:
            worker.status = WorkerStatus.cancelled
            worker.finished_at = worker.finished_at or now
    session.flush()
    store_final_bills(session, [run], now=now)
    return cancel_orders(run, reason or str(status), skip_nodes=skip_nodes) if launched else []


def begin_cancel(session: Session, *, run: Run, reason: str, now: datetime | None = None) -> list[CancelOrder]:
    """Cancel an active run and return the cancel orders for its nodes.

    A queued run ends `cancelled` at once. A launched one reads `cancelling`: its ranks never
    sent a launch order are cancelled now, the others when their agents report them gone
    (`settle_cancel`), and its GPUs stay held meanwhile.
    """
    if run.status == Q:
        return end_run(session, run=run, status=RunStatus.cancelled, reason=reason, now=now)
    now = now or utcnow()
    move(run, C, now=now)
    run.reason = reason
    run.cancel_requested_at = now
    for worker in run.workers:
        if worker.status == WorkerStatus.planned:
            worker.status = WorkerStatus.cancelled
            worker.finished_at = now
    session.flush()
    orders = cancel_orders(run, reason)
    settle_cancel(session, run=run, now=now)
    return orders


def settle_cancel(session: Session, *, run: Run, now: datetime | None = None) -> bool:
    """End a `cancelling` run as `cancelled` once every rank has ended, with its final bill;
    whether it did."""
    if run.status != C or any(w.status not in FINISHED_WORKER_STATUSES for w in run.workers):
        return False
    now = now or utcnow()
    move(run, RunStatus.cancelled, now=now)
    session.flush()
    store_final_bills(session, [run], now=now)
    return True
