"""What a rank's start, exit or loss does to its run, by strategy.

A PS run's server copes without a worker: a worker that fails, is killed or goes silent
makes the run `degraded`, one that leaves cleanly (exit 0 with a reason, or stopped by its own
agent) is `left`. The server's success ends the run (its workers end by themselves); its
death, or any rank's death in an all-reduce run, restarts the run from its latest checkpoint
(`restart.restart_or_fail`). A server that gave up waiting for workers
(`EXIT_TOO_FEW_WORKERS`) fails the run: a restart would wait for the same missing workers; so
does a server (or all-reduce rank) that exits with an error before its attempt trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from app.config import Settings
from app.dispatch import Order
from app.lifecycle.launch import TRAINING, WAITING
from app.lifecycle.rejoin import rejoin
from app.lifecycle.restart import restart_or_fail
from app.lifecycle.states import end_run, move, settle_cancel
from app.models import Run, RunStatus, RunWorker, WorkerStatus
from app.models.runs import FINISHED_WORKER_STATUSES
from app.queries.events import record_event
from app.queries.final_bills import store_final_bills
from app.queries.run_profiles import refresh_profiles
from hybridtrain.contract import CAUSE_AGENT_STOPPING, EXIT_TOO_FEW_WORKERS, is_ps

DEGRADED = "degraded"
ROLE_EXITED = "role_exited"
# Worker ranks whose absence makes a run degraded.
OUT = frozenset({WorkerStatus.failed, WorkerStatus.left, WorkerStatus.cancelled})


@dataclass(frozen=True)
class Exit:
    """A rank's exit as its agent reported it."""

    exit_code: int | None = None
    signal: int | None = None
    cancelled: bool = False
    reason: str | None = None
    pid: int | None = None
    # The run's restart count the role was launched with, when the agent says it.
    attempt: int | None = None
    # Why the agent stopped it, when it did (hybridtrain.contract.STOP_CAUSES).
    cause: str | None = None

    @property
    def clean(self) -> bool:
        return self.exit_code == 0 and not self.signal


def _serves(run: Run, worker: RunWorker) -> bool:
    """Whether the run cannot train on without this rank (a PS server, any all-reduce rank)."""
    return worker.role == "ps" or not is_ps(run.strategy)


def rank_started(
    session: Session, *, run: Run, worker: RunWorker, pid: int | None, now: datetime,
    attempt: int | None = None,
) -> str | None:
    """Record a rank's start; returns why the role must stop instead (its run has ended, or
    it is a process of an attempt the run has restarted from)."""
    if run.status == RunStatus.cancelling:
        return run.reason or f"run {run.id} is being cancelled"
    if run.status.finished:
        return f"run {run.id} has {run.status}"
    if attempt is not None and attempt < run.restarts:
        return f"run {run.id} restarted: attempt {attempt} is over"
    if worker.status in WAITING:
        worker.status = WorkerStatus.running
        worker.pid = pid
        worker.started_at = now
    if run.status in (RunStatus.queued, RunStatus.launching, RunStatus.restarting) and not any(
        w.status in WAITING for w in run.workers
    ):
        out = any(w.role == "worker" and w.status in OUT for w in run.workers) and is_ps(run.strategy)
        move(run, RunStatus.degraded if out else RunStatus.running, now=now)
    session.flush()
    return None


def is_stale(run: Run, worker: RunWorker, exit: Exit) -> bool:
    """Whether an exit report is of a process of an earlier attempt (the run restarted since).

    The attempt the agent names decides; without one, the pid: a restart forgets each rank's
    pid until its new process starts, so an exit naming a pid is then the old process's, as is
    one naming another pid than the new process's.
    """
    if exit.attempt is not None:
        return exit.attempt < run.restarts
    if exit.pid is None or run.restarts == 0:
        return False
    if worker.pid is None:
        return worker.status in WAITING
    return exit.pid != worker.pid


def _exit_text(worker: RunWorker, exit: Exit) -> str:
    if exit.signal:
        return f"rank {worker.rank} ({worker.role}) was killed by signal {exit.signal}"
    return f"rank {worker.rank} ({worker.role}) exited with code {exit.exit_code}"


def rank_exited(
    session: Session, *, run: Run, worker: RunWorker, node_name: str, exit: Exit,
    settings: Settings, now: datetime,
) -> list[Order]:
    """Record a rank's exit and move its run on; returns the orders to send after commit."""
    if is_stale(run, worker, exit):
        return []
    # The first report of an exit wins (an event and a heartbeat may both carry it); a rank
    # that the run's end already marked cancelled still gets its exit code.
    if worker.exit_code is None and worker.signal is None:
        worker.exit_code, worker.signal = exit.exit_code, exit.signal
        worker.pid = worker.pid or exit.pid
    if worker.status in FINISHED_WORKER_STATUSES:
        worker.finished_at = worker.finished_at or now
        session.flush()
        return []
    worker.finished_at = now
    if run.status.over:
        worker.status = WorkerStatus.cancelled if exit.cancelled else (
            WorkerStatus.succeeded if exit.clean else WorkerStatus.failed)
        worker.reason = exit.reason
        session.flush()
        if worker.status == WorkerStatus.succeeded and worker.role == "worker":
            # A PS worker leaves after its server's goodbye: its last steps are in now.
            refresh_profiles(session, run=run, now=now)
        # A cancelled run's last rank reported gone: its GPUs are free for the queue.
        settle_cancel(session, run=run, now=now)
        # An ended run's last rank: its bill is final.
        store_final_bills(session, [run], now=now)
        return []
    where = f"on node {node_name}"
    if exit.clean and not _serves(run, worker) and (exit.cancelled or exit.reason or exit.cause == CAUSE_AGENT_STOPPING):
        # A PS worker that left at a step boundary (its agent stopped it: a spot notice).
        worker.status = WorkerStatus.left
        worker.reason = exit.reason or f"rank {worker.rank} (worker) was stopped by its agent"
        return _degrade(session, run=run, worker=worker, detail=f"{worker.reason} ({where})", now=now)
    if exit.clean and not exit.cancelled:
        worker.status = WorkerStatus.succeeded
        session.flush()
        if worker.role == "ps" or all(w.status == WorkerStatus.succeeded for w in run.workers):
            return end_run(session, run=run, status=RunStatus.succeeded, reason=None, now=now)
        return []
    worker.status = WorkerStatus.cancelled if exit.cancelled else WorkerStatus.failed
    worker.reason = exit.reason or _exit_text(worker, exit)
    cause = f"{worker.reason} {where}"
    record_event(session, run=run, kind=ROLE_EXITED, subject=worker.rank, node_id=worker.node_id,
                 detail=cause, t=now)
    if worker.role == "ps" and exit.exit_code == EXIT_TOO_FEW_WORKERS:
        return end_run(session, run=run, status=RunStatus.failed, now=now,
                       reason=f"the server gave up waiting for workers: {cause}")
    if _serves(run, worker) and run.status not in TRAINING and exit.exit_code and not exit.signal:
        # An error before the attempt trained (a bad task argument, a missing module) would
        # only repeat: the run fails fast instead of spending its restarts on it.
        spare = run.restarts < run.max_restarts
        return end_run(session, run=run, status=RunStatus.failed, now=now,
                       reason=f"{cause}; it failed while starting, so it was not restarted" if spare else cause)
    if not _serves(run, worker) and _every_worker_errored(run):
        # No worker is left and each one ended with an error of its own (a bad task argument,
        # a missing module), not a signal: a joiner would fail the same way, so the run does
        # not wait --min-workers-wait-s for one.
        return end_run(session, run=run, status=RunStatus.failed, now=now, reason=f"every worker failed: {cause}")
    # A worker killed by a signal (the OOM killer, its agent restarting) may rejoin; one that
    # failed with an error of its own would fail the same way again, and one its stopping
    # agent killed is on a node that is going away.
    rejoins = bool(exit.signal) and not exit.cancelled and exit.cause != CAUSE_AGENT_STOPPING
    return lose(session, run=run, worker=worker, cause=cause, settings=settings, now=now, rejoins=rejoins)


def _every_worker_errored(run: Run) -> bool:
    workers = [w for w in run.workers if w.role == "worker"]
    return bool(workers) and all(
        w.status == WorkerStatus.failed and w.exit_code not in (None, 0) and not w.signal for w in workers)


def rank_lost(
    session: Session, *, run: Run, worker: RunWorker, reason: str, settings: Settings, now: datetime,
    rejoins: bool = True,
) -> list[Order]:
    """A rank that is gone without an exit report (its node silent, its agent restarted); a
    PS worker that `rejoins` comes back from its node once it can (one that never started
    does not: its node did not take the order)."""
    if worker.status in FINISHED_WORKER_STATUSES or run.status.finished:
        return []
    worker.finished_at = now
    worker.reason = reason
    if run.status == RunStatus.cancelling:
        # Gone with its agent or its node (whose guard ends the role with the agent): nothing
        # of the run is left to stop there.
        worker.status = WorkerStatus.cancelled
        record_event(session, run=run, kind=ROLE_EXITED, subject=worker.rank, node_id=worker.node_id,
                     detail=reason, t=now)
        settle_cancel(session, run=run, now=now)
        return []
    worker.status = WorkerStatus.failed
    record_event(session, run=run, kind=ROLE_EXITED, subject=worker.rank, node_id=worker.node_id,
                 detail=reason, t=now)
    return lose(session, run=run, worker=worker, cause=reason, settings=settings, now=now, rejoins=rejoins)


def lose(
    session: Session, *, run: Run, worker: RunWorker, cause: str, settings: Settings, now: datetime,
    rejoins: bool = False,
) -> list[Order]:
    """The run without `worker`: degraded (a PS worker), restarted or failed (the others). A
    PS worker that `rejoins` comes back from its node where it can (`rejoin.rejoin`)."""
    if _serves(run, worker):
        return restart_or_fail(session, run=run, cause=cause, settings=settings, now=now)
    orders = _degrade(session, run=run, worker=worker, detail=cause, now=now)
    if rejoins:
        orders += rejoin(session, run=run, lost=worker, settings=settings, now=now)
    return orders


def _degrade(session: Session, *, run: Run, worker: RunWorker, detail: str, now: datetime) -> list[Order]:
    # A restart in progress stays one: its ranks' starts decide between running and degraded.
    if run.status != RunStatus.restarting:
        if run.status != RunStatus.degraded:
            move(run, RunStatus.degraded, now=now)
        record_event(session, run=run, kind=DEGRADED, subject=worker.rank, node_id=worker.node_id,
                     detail=detail, t=now)
    session.flush()
    return []
