"""Ended runs' final bills, stored on the run so that the overview and the runs list stop
summing every ended run's metrics on each view (docs/costs.md, "Final bills").

A run's bill is final once the run and each of its ranks have ended. After that, only a late
report (a trainer's last records, an agent's spool) or an edit of what prices the run (its
nodes, their sites, a data set it read, a price series started in its past) changes it. The
transaction that makes a bill final stores it (`store_final_bills`, called by
`app.lifecycle`); whatever changes it later clears it (the `clear_*` functions), and the
liveness monitor stores it again (`settle_final_bills`), as it does for runs that ended
before bills were stored.

A bill stored while a late record is being inserted must not miss it. So a bill is stored
under its run's row lock (FOR UPDATE), taken before its inputs are read, and an insert of a
metric or event takes a key-share lock on the run's row for its foreign key, which FOR UPDATE
excludes: an insert that comes first is committed, and read, before the bill is; one that
comes after waits for the bill's commit and then finds the bill, either by a statement after
the insert (events) or by reading the run under its own key-share lock within the insert
(metrics: a locking read answers with the row as it is once locked, not as the statement's
snapshot had it), and clears it. An edit clears every run it touches, stored bill or not, so
that it waits for a bill being stored at that moment instead of passing it by. On SQLite (one
process, one writer) a store writes to the runs before it reads, which makes the reads and the
store one write transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from sqlalchemy import ColumnElement, exists, func, select, update
from sqlalchemy.orm import Session, lazyload, selectinload

from app.billing import Bill
from app.errors import HybridtrainError
from app.models import Node, Run, RunWorker
from app.models.runs import FINISHED_RUN_STATUSES, FINISHED_WORKER_STATUSES
from app.queries.costs import id_chunks, run_bills

log = logging.getLogger(__name__)

# The fields of a node that its runs' bills read (its name labels their links); the others
# (labels, address, status) leave bills alone.
NODE_BILLING_FIELDS = frozenset({"name", "site_id", "spot", "instance_type", "amortised_usd_per_h", "gpus"})


def bill_is_final(run: Run) -> bool:
    """Whether `run` and every rank of it have ended (a succeeded PS run's workers end after it)."""
    return run.status.finished and all(w.status in FINISHED_WORKER_STATUSES for w in run.workers)


def store_final_bills(session: Session, runs: Sequence[Run], *, now: datetime) -> int:
    """Store the bills of those of `runs` that are final and not stored yet, billed together
    (`run_bills`, as the run page bills each); returns how many were stored. `runs` come with
    their workers."""
    due = [run for run in runs if run.billed_at is None and bill_is_final(run)]
    if not due:
        return 0
    _hold(session, [run.id for run in due])
    bills = _bills(session, due, now=now)
    for run in due:
        bill = bills.get(run.id)
        if bill is None:
            continue
        run.billed_usd = bill.total_usd
        run.billed_unpriced = bool(bill.unpriced)
        run.billed_at = now
    session.flush()
    return len(bills)


def settle_final_bills(session: Session, *, now: datetime, limit: int) -> int:
    """Store up to `limit` final bills that are missing (cleared by a late report or an edit,
    or of runs that ended before bills were stored), oldest run first, passing over runs that
    another transaction holds; returns how many were stored."""
    unfinished = exists().where(RunWorker.run_id == Run.id, RunWorker.status.not_in(FINISHED_WORKER_STATUSES))
    runs = session.scalars(
        select(Run)
        .where(Run.status.in_(FINISHED_RUN_STATUSES), Run.billed_at.is_(None), ~unfinished)
        .order_by(Run.id)
        .limit(limit)
        .with_for_update(skip_locked=True, of=Run)
        .options(selectinload(Run.workers), lazyload(Run.events))
        .execution_options(populate_existing=True)
    ).all()
    return store_final_bills(session, runs, now=now)


@dataclass(frozen=True)
class Spend:
    """What runs have spent: the stored final bills plus the others billed now (`live`)."""

    usd: Decimal
    runs: int
    unpriced: bool
    live: Mapping[int, Bill] = field(default_factory=dict)


def spend_of_all_runs(session: Session, *, now: datetime) -> Spend:
    """Every run's spend: ended runs' stored bills, and the rest billed live in grouped queries."""
    # One read of every run's stored bill, so that a bill stored or cleared meanwhile counts once.
    rows = session.execute(select(Run.id, Run.billed_at, Run.billed_usd, Run.billed_unpriced)).all()
    stored = [row for row in rows if row.billed_at is not None]
    live = run_bills(session, _runs_with_workers(session, [row.id for row in rows if row.billed_at is None]), now=now)
    return Spend(
        usd=sum((row.billed_usd or Decimal(0) for row in stored), Decimal(0))
        + sum((bill.total_usd for bill in live.values()), Decimal(0)),
        runs=len(rows),
        unpriced=any(row.billed_unpriced for row in stored) or any(bill.unpriced for bill in live.values()),
        live=live,
    )


def clear_late_bill(session: Session, *, run_id: int) -> None:
    """Clear the run's stored bill: a record it sums was stored after it (call after the
    insert, whose lock on the run orders it against a bill being stored)."""
    _clear(session, Run.id == run_id, Run.billed_at.is_not(None))


def clear_bills_on_nodes(session: Session, *, node_ids: Sequence[int]) -> None:
    """Clear the bills of every run with a rank on these nodes, before they change or go."""
    _clear(session, Run.id.in_(select(RunWorker.run_id).where(RunWorker.node_id.in_(node_ids))))


def clear_bills_at_site(session: Session, *, site_id: int) -> None:
    """Clear the bills of every run with a rank on a node of this site, before it changes."""
    on_site = select(RunWorker.run_id).join(Node, Node.id == RunWorker.node_id).where(Node.site_id == site_id)
    _clear(session, Run.id.in_(on_site))


def clear_bills_reading(session: Session, *, dataset: str) -> None:
    """Clear the bills of the runs that read this data set, before it goes (their reads are
    then no longer priced)."""
    readers = [
        run_id for run_id, names in session.execute(select(Run.id, Run.datasets).where(Run.datasets.is_not(None)))
        if dataset in (names or ())
    ]
    for chunk in id_chunks(readers):
        _clear(session, Run.id.in_(chunk))


def clear_bills_priced_since(session: Session, *, since: datetime) -> None:
    """Clear the bills of the runs priced at or after `since`: a price series starting then
    prices what had none, or takes over from the any-continent series. (A revision or a
    withdrawal only ever concerns the future, which no ended run is priced at.)"""
    _clear(session, func.coalesce(Run.started_at, Run.launched_at, Run.created_at) >= since)


def _clear(session: Session, *criteria: ColumnElement[bool]) -> None:
    session.execute(
        update(Run).where(*criteria).values(billed_usd=None, billed_unpriced=None, billed_at=None)
        .execution_options(synchronize_session=False)
    )


def _hold(session: Session, run_ids: Sequence[int]) -> None:
    """Lock the runs' rows until the commit, before their bills' inputs are read (module doc)."""
    for chunk in id_chunks(run_ids):
        if session.get_bind().dialect.name == "postgresql":
            session.execute(select(Run.id).where(Run.id.in_(chunk)).order_by(Run.id).with_for_update())
        else:
            # SQLite: any write takes the database's one write lock, under which nothing else commits.
            session.execute(
                update(Run).where(Run.id.in_(chunk)).values(billed_at=Run.billed_at)
                .execution_options(synchronize_session=False)
            )


def _bills(session: Session, runs: Sequence[Run], *, now: datetime) -> dict[int, Bill]:
    """`run_bills`, leaving out a run whose figures cannot be billed (logged) rather than
    failing the run's end or the others' bills: it stays billed live."""
    try:
        return run_bills(session, runs, now=now)
    except HybridtrainError as exc:
        if len(runs) == 1:
            log.warning("run %d: its final bill cannot be stored: %s", runs[0].id, exc.message)
            return {}
    return {run_id: bill for run in runs for run_id, bill in _bills(session, [run], now=now).items()}


def _runs_with_workers(session: Session, run_ids: Sequence[int]) -> list[Run]:
    # Not their events (Run.events loads with a run by default): a bill reads only membership changes.
    runs: list[Run] = []
    for chunk in id_chunks(run_ids):
        runs.extend(session.scalars(
            select(Run).where(Run.id.in_(chunk)).options(selectinload(Run.workers), lazyload(Run.events))))
    return runs
