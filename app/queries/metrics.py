"""Metric ingestion (bulk, exactly once) and series reads (server-side downsampling).

Each record is stored once per (run, rank, stream, seq): the trainer numbers the records of
each process, its reporter and its agent may deliver a record more than once, and the
unique key turns every re-delivery into a no-op. Ingestion also learns the step count of a
run given in epochs: the trainer's rank 0 reports `max_steps` at step 0, and a run whose
max_steps is still NULL stores it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timedelta

from sqlalchemy import Float, case, cast, func, select, text, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from app.errors import NotFoundError
from app.models import Run, RunMetric
from app.models.base import utcnow
from app.queries.costs import BILLED_METRICS
from app.queries.final_bills import clear_late_bill
from app.run_secrets import token_rank
from app.schemas.runs import MetricRecord, MetricSeries

NO_PEER = -1

# Postgres: one statement for the whole batch, the columns as arrays. It beats a multi-row
# VALUES (one bind parameter per array instead of seven per row) and lets the unique key
# skip re-delivered records without a round trip per row.
#
# Metrics are telemetry that the trainer may resend (and keeps in its own JSON-lines file), so
# this transaction commits without waiting for the WAL flush (synchronous_commit off, for it
# alone): a Postgres crash may lose the last fraction of a second of metrics, and ingestion
# stops paying a disk flush per batch. The setting rides in a CTE to save a round trip.
#
# The statement also says whether the run has a stored final bill, read under a key-share lock
# on the run's row (which the foreign key takes anyway): a locking read answers with the row as
# of the lock, so a bill whose storing the insert had to wait for shows (app.queries.final_bills),
# and a batch needs no statement of its own to find out.
_PG_INSERT = text(
    """
    WITH async_commit AS (SELECT set_config('synchronous_commit', 'off', true)),
    run AS (SELECT billed_at IS NOT NULL AS billed FROM runs WHERE id = :run_id FOR KEY SHARE),
    inserted AS (
        INSERT INTO run_metrics (run_id, name, rank, peer, step, t, value, stream, seq)
        SELECT :run_id, m.name, m.rank, m.peer, m.step, m.t, m.value, m.stream, m.seq
        FROM unnest(CAST(:names AS text[]), CAST(:ranks AS integer[]), CAST(:peers AS integer[]),
                    CAST(:steps AS integer[]), CAST(:ts AS double precision[]),
                    CAST(:vals AS double precision[]), CAST(:streams AS text[]),
                    CAST(:seqs AS bigint[]))
             AS m(name, rank, peer, step, t, value, stream, seq)
             CROSS JOIN async_commit
        ON CONFLICT (run_id, rank, stream, seq) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM inserted) AS stored, coalesce((SELECT billed FROM run), false) AS billed
    """
)


def metrics_token_valid(session: Session, *, run_id: int, token: str, secret_key: str) -> bool:
    """Whether `token` is one of the run's ranks' tokens of its current attempt (NotFoundError
    when there is no such run). Not cached: a restart retires every old token."""
    attempt = session.scalar(select(Run.restarts).where(Run.id == run_id))
    if attempt is None:
        raise NotFoundError("run", run_id)
    return token_rank(secret_key, token, run_id=run_id, attempt=attempt) is not None


def report_refusal(session: Session, *, run_id: int, token: str, secret_key: str, grace_s: float,
                   ranks: Collection[int], now: datetime | None = None) -> tuple[int, str] | None:
    """Why `token` may not report records of `ranks` into run `run_id` now, as (HTTP status,
    detail); None when it may. A rank's token reports that rank's records, while the run is
    active and for `grace_s` after it ended (its workers' last records in flight); after that
    only the node's agent delivers what a trainer spooled (`POST /agent/runs/{id}/metrics`),
    so a leaked token is worth nothing."""
    row = session.execute(
        select(Run.restarts, Run.status, Run.finished_at).where(Run.id == run_id)
    ).one_or_none()
    if row is None:
        raise NotFoundError("run", run_id)
    rank = token_rank(secret_key, token, run_id=run_id, attempt=row.restarts)
    if rank is None:
        return 401, "not a report token of this run's current attempt"
    others = sorted(set(ranks) - {rank})
    if others:
        return 403, (f"rank {rank}'s token reports rank {rank}'s records only, not rank(s) "
                     f"{', '.join(map(str, others))}")
    now = now or utcnow()
    if row.status.finished and (row.finished_at is None or row.finished_at < now - timedelta(seconds=grace_s)):
        return 403, (f"run {run_id} has {row.status}: a token of it reports no more; the agents deliver "
                     "what their trainers spooled")
    return None


def _learn_max_steps(session: Session, run_id: int, records: Sequence[MetricRecord]) -> None:
    reported = [r for r in records if r.name == "max_steps" and r.value is not None and r.value >= 1]
    if not reported:
        return
    steps = int(min(reported, key=lambda r: r.rank).value)  # type: ignore[arg-type]
    # Conditional: a run's step count, once known, never changes (a resent batch is a no-op).
    session.execute(
        update(Run).where(Run.id == run_id, Run.max_steps.is_(None)).values(max_steps=steps)
        .execution_options(synchronize_session=False)
    )


def record_key(record: MetricRecord) -> tuple[str, int]:
    """The record's (stream, seq); a record without them (an older trainer) is keyed by what
    identified it before, its name, peer and step."""
    stream: str | None = getattr(record, "stream", None)
    seq: int | None = getattr(record, "seq", None)
    if stream is not None and seq is not None:
        return stream, seq
    return f"~{record.name}/{NO_PEER if record.peer is None else record.peer}", record.step


def store_metrics(session: Session, *, run_id: int, records: Sequence[MetricRecord]) -> int:
    """Insert the records once per (run, rank, stream, seq); returns how many were new.
    A reported `max_steps` becomes the run's when it had none (a run given in epochs); new
    records a bill sums clear the run's stored final bill (a late report)."""
    if not records:
        return 0
    _learn_max_steps(session, run_id, records)
    stored, billed = _insert_metrics(session, run_id, records)
    if stored and billed and any(r.name in BILLED_METRICS for r in records):
        clear_late_bill(session, run_id=run_id)
    return stored


def _insert_metrics(session: Session, run_id: int, records: Sequence[MetricRecord]) -> tuple[int, bool]:
    """How many records were new, and whether the run may have a stored final bill (SQLite,
    whose one writer the insert now is, leaves that to the clearing statement)."""
    keys = [record_key(r) for r in records]
    if session.get_bind().dialect.name == "postgresql":
        row = session.execute(
            _PG_INSERT,
            {
                "run_id": run_id,
                "names": [r.name for r in records],
                "ranks": [r.rank for r in records],
                "peers": [NO_PEER if r.peer is None else r.peer for r in records],
                "steps": [r.step for r in records],
                "ts": [r.t for r in records],
                "vals": [r.value for r in records],
                "streams": [k[0] for k in keys],
                "seqs": [k[1] for k in keys],
            },
        ).one()
        return int(row.stored), bool(row.billed)
    stmt = sqlite_insert(RunMetric.__table__).on_conflict_do_nothing(
        index_elements=["run_id", "rank", "stream", "seq"]
    )
    rows = [
        {
            "run_id": run_id, "name": r.name, "rank": r.rank,
            "peer": NO_PEER if r.peer is None else r.peer, "step": r.step, "t": r.t, "value": r.value,
            "stream": stream, "seq": seq,
        }
        for r, (stream, seq) in zip(records, keys)
    ]
    # Core, not ORM, execution: its result counts the rows the statement really inserted.
    return session.connection().execute(stmt, rows).rowcount or 0, True


def read_metrics(
    session: Session,
    *,
    run_id: int,
    names: Sequence[str] = (),
    rank: int | None = None,
    since: float | None = None,
    max_points: int = 1000,
) -> tuple[list[MetricSeries], float | None]:
    """The run's series (name, rank, peer), each at most `max_points` long, and the newest t.

    A series of at most `max_points` comes back whole, point by point in time order (a step
    trained twice after a resume shows twice). A longer one is cut into `max_points` equal
    step ranges; each becomes one point with the range's last step and t and its mean value,
    all in one grouped query.
    """
    if session.get(Run, run_id) is None:
        raise NotFoundError("run", run_id)
    m = RunMetric.__table__
    conds = [m.c.run_id == run_id]
    if names:
        conds.append(m.c.name.in_(list(names)))
    if rank is not None:
        conds.append(m.c.rank == rank)
    if since is not None:
        conds.append(m.c.t > since)
    # Window functions give each row its series' step range and size in the same scan, so
    # the plan does not depend on table statistics (a join against a grouped subquery
    # did: 6 s instead of 40 ms on a freshly filled, not yet analysed table).
    series_key = [m.c.name, m.c.rank, m.c.peer]
    lo = func.min(m.c.step).over(partition_by=series_key)
    hi = func.max(m.c.step).over(partition_by=series_key)
    n = func.count().over(partition_by=series_key)
    # The row's place in time: its own bucket when the whole series fits.
    place = func.row_number().over(partition_by=series_key, order_by=(m.c.t, m.c.stream, m.c.seq))
    # `//` is integer division on both backends (`/` divides as NUMERIC on Postgres).
    step_range = (m.c.step - lo) * max_points // (hi - lo + 1)
    inner = (
        select(
            m.c.name, m.c.rank, m.c.peer, m.c.step, m.c.t, m.c.value,
            case((n <= max_points, place), else_=step_range).label("b"),
            n.label("n"),
        )
        .where(*conds)
        .subquery("x")
    )
    x = inner.c
    rows = session.execute(
        select(
            x.name, x.rank, x.peer, x.b,
            func.max(x.step), func.max(x.t), func.avg(cast(x.value, Float)), x.n,
        )
        .group_by(x.name, x.rank, x.peer, x.b, x.n)
        .order_by(x.name, x.rank, x.peer, x.b)
    ).all()

    series: list[MetricSeries] = []
    last_t: float | None = None
    current: MetricSeries | None = None
    for name, rank_, peer, _b, step, t, value, n in rows:
        key = (name, rank_, None if peer == NO_PEER else peer)
        if current is None or (current.name, current.rank, current.peer) != key:
            current = MetricSeries(name=name, rank=rank_, peer=key[2], count=int(n),
                                   downsampled=False, points=[])
            series.append(current)
        current.points.append((int(step), float(t), None if value is None else float(value)))
        last_t = t if last_t is None or t > last_t else last_t
    for s in series:
        s.downsampled = len(s.points) < s.count
    return series, last_t


_NAMES = text(
    """
    WITH RECURSIVE names(name) AS (
        SELECT min(name) FROM run_metrics WHERE run_id = :run_id
        UNION ALL
        SELECT (SELECT min(m.name) FROM run_metrics m WHERE m.run_id = :run_id AND m.name > names.name)
        FROM names WHERE names.name IS NOT NULL
    )
    SELECT name FROM names WHERE name IS NOT NULL
    """
)


def metric_names(session: Session, *, run_id: int) -> list[str]:
    """Every metric name the run reported, sorted.

    A skip scan over the (run_id, name, ...) series index, one probe per name: a run of
    hundreds of thousands of records has only a dozen or two names, so this stays fast
    where a plain DISTINCT would read every record.
    """
    return [row[0] for row in session.execute(_NAMES, {"run_id": run_id})]
