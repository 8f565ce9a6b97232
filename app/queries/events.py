"""A run's events: recorded by the control plane's lifecycle, or ingested from the trainer's
metrics stream (deduplicated by stream and sequence number), and read back oldest first."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from app.billing import MEMBERSHIP_KINDS
from app.errors import InvalidFieldError, NotFoundError
from app.models import Run, RunEvent, RunWorker
from app.models.base import utcnow
from app.models.events import EventSource
from app.queries.final_bills import clear_late_bill
from app.schemas.reports import TrainerEventRecord

MAX_KIND = 32
_MAX_DETAIL = 4000
# Rows per INSERT: ten columns each stays under SQLite's and Postgres' bind-parameter limits.
_CHUNK = 500


def record_event(
    session: Session,
    *,
    run: Run,
    kind: str,
    subject: int | None = None,
    node_id: int | None = None,
    step: int | None = None,
    detail: str = "",
    t: datetime | None = None,
    source: str = "control_plane",
) -> RunEvent:
    """Add one event to the run's timeline (flushed, not committed: the caller's transaction
    decides, so an event is stored with the state change it describes)."""
    if not kind or len(kind) > MAX_KIND:
        raise InvalidFieldError("kind", f"event kind {kind!r}: 1-{MAX_KIND} characters")
    try:
        origin = EventSource(source)
    except ValueError:
        allowed = ", ".join(s.value for s in EventSource)
        raise InvalidFieldError("source", f"event source {source!r}: one of {allowed}") from None
    if node_id is None and subject is not None:
        node_id = _node_of_rank(session, run_id=run.id, rank=subject)
    # Through the relationship, so a run whose events are already loaded lists the new one too.
    event = RunEvent(
        run=run, kind=kind, subject=subject, node_id=node_id, step=step,
        detail=detail[:_MAX_DETAIL], t=t or utcnow(), source=origin,
    )
    session.add(event)
    session.flush()
    return event


def list_events(session: Session, *, run_id: int) -> Sequence[RunEvent]:
    """The run's events, oldest first (NotFoundError when there is no such run)."""
    if session.get(Run, run_id) is None:
        raise NotFoundError("run", run_id)
    return session.scalars(
        select(RunEvent).where(RunEvent.run_id == run_id).order_by(RunEvent.t, RunEvent.id)
    ).all()


def store_trainer_events(session: Session, *, run_id: int, records: Sequence[TrainerEventRecord]) -> int:
    """Insert the trainer's event records once per (run, stream, seq); returns how many were new.
    A record without a stream (an older trainer) has no key and is always stored. A new
    membership change clears the run's stored final bill (a late report)."""
    if not records:
        return 0
    nodes = _nodes_of_ranks(session, run_id=run_id)
    rows = [
        {
            "run_id": run_id,
            "t": datetime.fromtimestamp(r.t, UTC),
            "kind": r.event,
            "subject": r.subject,
            "node_id": None if r.subject is None else nodes.get(r.subject),
            "step": r.step,
            "detail": r.detail[:_MAX_DETAIL],
            "source": EventSource.trainer.value,
            "stream": r.stream,
            "seq": r.seq,
        }
        for r in records
    ]
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    stored = 0
    for i in range(0, len(rows), _CHUNK):
        stmt = (
            insert(RunEvent.__table__).values(rows[i : i + _CHUNK])
            .on_conflict_do_nothing(index_elements=["run_id", "stream", "seq"])
            # The rows really inserted (psycopg's count is otherwise dropped for an INSERT).
            .execution_options(preserve_rowcount=True)
        )
        stored += max(0, session.connection().execute(stmt).rowcount)
    if stored and any(r.event in MEMBERSHIP_KINDS and r.subject is not None for r in records):
        clear_late_bill(session, run_id=run_id)
    return stored


def _node_of_rank(session: Session, *, run_id: int, rank: int) -> int | None:
    return session.scalar(
        select(RunWorker.node_id).where(RunWorker.run_id == run_id, RunWorker.rank == rank)
    )


def _nodes_of_ranks(session: Session, *, run_id: int) -> dict[int, int | None]:
    rows = session.execute(
        select(RunWorker.rank, RunWorker.node_id).where(RunWorker.run_id == run_id)
    ).all()
    return {rank: node_id for rank, node_id in rows}
