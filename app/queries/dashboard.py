"""Read-only queries the web dashboard needs and no REST resource does: counts by status,
inventory overviews, scheduled price versions, links' bytes summed per step bucket, new
metric and log rows for the live stream, and a run's bill so far from `app.billing`.

Plain functions, as every query module; nothing here writes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from app.models import (
    EgressPrice,
    GpuModel,
    InstancePrice,
    Node,
    NodeGpu,
    NodeStatus,
    Run,
    RunLog,
    RunMetric,
    Site,
)
from app.models.base import utcnow
from app.models.runs import ACTIVE_RUN_STATUSES


@dataclass
class SiteSummary:
    """A site with how many of its nodes are in each status and how many GPUs are online."""

    site: Site
    nodes_by_status: dict[NodeStatus, int] = field(default_factory=dict)
    gpus_online: int = 0

    @property
    def node_count(self) -> int:
        return sum(self.nodes_by_status.values())


def site_summaries(session: Session) -> list[SiteSummary]:
    """Every site, ordered by name, with its nodes counted by status."""
    summaries = {site.id: SiteSummary(site) for site in session.scalars(select(Site).order_by(Site.name))}
    counts = session.execute(select(Node.site_id, Node.status, func.count()).group_by(Node.site_id, Node.status))
    for site_id, status, count in counts:
        summaries[site_id].nodes_by_status[NodeStatus(status)] = int(count)
    gpus = session.execute(
        select(Node.site_id, func.coalesce(func.sum(NodeGpu.count), 0))
        .join(NodeGpu, NodeGpu.node_id == Node.id)
        .where(Node.status == NodeStatus.online)
        .group_by(Node.site_id)
    )
    for site_id, count in gpus:
        summaries[site_id].gpus_online = int(count)
    return list(summaries.values())


def node_status_totals(session: Session) -> dict[NodeStatus, int]:
    """How many nodes are in each status (every status present, zeros included)."""
    totals = {status: 0 for status in NodeStatus}
    for status, count in session.execute(select(Node.status, func.count()).group_by(Node.status)):
        totals[NodeStatus(status)] = int(count)
    return totals


def nodes_with_sites(session: Session, *, skip: int, limit: int) -> tuple[Sequence[Node], int]:
    """A page of nodes ordered by site name then node name, their site and GPUs loaded."""
    count = session.scalar(select(func.count()).select_from(Node)) or 0
    stmt = (
        select(Node)
        .join(Node.site)
        .options(selectinload(Node.gpus), selectinload(Node.site))
        .order_by(Site.name, Node.name)
        .offset(skip)
        .limit(limit)
    )
    return session.scalars(stmt).all(), int(count)


def scheduled_prices(session: Session, *, now: datetime | None = None) -> tuple[list[InstancePrice], list[EgressPrice]]:
    """Price versions that take effect in the future (not yet in force), soonest first."""
    at = now or utcnow()
    instances = session.scalars(
        select(InstancePrice).where(InstancePrice.effective_from > at).order_by(InstancePrice.effective_from)
    ).all()
    egress = session.scalars(
        select(EgressPrice).where(EgressPrice.effective_from > at).order_by(EgressPrice.effective_from)
    ).all()
    return list(instances), list(egress)


def gpu_totals_by_model(session: Session) -> dict[str, int]:
    """GPUs declared on online nodes, by model name."""
    rows = session.execute(
        select(GpuModel.name, func.sum(NodeGpu.count))
        .join(NodeGpu, NodeGpu.gpu_model_id == GpuModel.id)
        .join(Node, Node.id == NodeGpu.node_id)
        .where(Node.status == NodeStatus.online)
        .group_by(GpuModel.name)
        .order_by(GpuModel.name)
    )
    totals: dict[str, int] = defaultdict(int)
    for name, count in rows:
        totals[name] += int(count or 0)
    return dict(totals)


# --- egress bytes, summed per bucket in the database --------------------------------------------------


def bucket_width(max_steps: int, max_points: int) -> int:
    """Steps per bucket so that `max_steps` steps make at most `max_points` points."""
    return max(1, math.ceil(max(1, max_steps) / max(1, max_points)))


class SeriesBucket(NamedTuple):
    """One bucket of `width` steps of one series: its last step and t, mean and sum of values."""

    name: str
    rank: int
    peer: int
    bucket: int
    step: int
    t: float
    mean: float | None
    total: float | None


def run_series(session: Session, *, run_id: int, names: Iterable[str], width: int) -> list[SeriesBucket]:
    """Every (name, rank, peer) series of `names`, cut into buckets of `width` steps, in one
    scan and one GROUP BY: a finished 10,000-step run of 4 workers comes back as a few thousand
    rows. Means draw the rates and losses; sums accumulate bytes (the egress chart and bill).

    `app.queries.metrics.read_metrics` (the REST API's) cuts each series to its own step range
    and so reads the rows twice; the run page needs every series at once, on one step grid.
    """
    # `//`: SQLAlchemy 2 renders `/` on integers as true division.
    bucket = (RunMetric.step // width) if width > 1 else RunMetric.step
    bucket = bucket.label("bucket")
    stmt = (
        select(
            RunMetric.name, RunMetric.rank, RunMetric.peer, bucket,
            func.max(RunMetric.step), func.max(RunMetric.t), func.avg(RunMetric.value), func.sum(RunMetric.value),
        )
        .where(RunMetric.run_id == run_id, RunMetric.name.in_(list(names)))
        .group_by(RunMetric.name, RunMetric.rank, RunMetric.peer, bucket)
        .order_by(RunMetric.name, RunMetric.rank, RunMetric.peer, bucket)
    )
    # Core rows straight into the tuple: the columns are already ints and floats (avg and sum of
    # a double are doubles), and converting each of a live run's ~10^4 rows was a third of its page.
    return list(map(SeriesBucket._make, session.connection().execute(stmt).all()))


# --- what the live stream reads -------------------------------------------------------------------


def max_metric_id(session: Session, *, run_id: int) -> int:
    """The highest metric id of a run so far (0 if none): where a live stream starts."""
    return int(session.scalar(select(func.max(RunMetric.id)).where(RunMetric.run_id == run_id)) or 0)


def metrics_after(session: Session, *, run_id: int, after_id: int, limit: int = 5000) -> list[RunMetric]:
    """A run's metric rows with id above `after_id`, in id order.

    The id range comes first in the WHERE so the primary key index serves it: for a live run
    the rows above the cursor are only the last moments' rows of all runs.
    """
    return list(
        session.scalars(
            select(RunMetric).where(RunMetric.id > after_id, RunMetric.run_id == run_id).order_by(RunMetric.id).limit(limit)
        )
    )


def max_log_id(session: Session, *, run_id: int) -> int:
    """The highest log id of a run so far (0 if none)."""
    return int(session.scalar(select(func.max(RunLog.id)).where(RunLog.run_id == run_id)) or 0)


def logs_after(session: Session, *, run_id: int, after_id: int, limit: int = 1000) -> list[RunLog]:
    """A run's log lines with id above `after_id`, in id order."""
    return list(
        session.scalars(
            select(RunLog).where(RunLog.id > after_id, RunLog.run_id == run_id).order_by(RunLog.id).limit(limit)
        )
    )


def active_runs(session: Session) -> list[Run]:
    """Runs not finished yet (queued, launching, running, degraded, restarting), newest first."""
    return list(
        session.scalars(select(Run).where(Run.status.in_(ACTIVE_RUN_STATUSES)).options(selectinload(Run.workers)).order_by(Run.id.desc()))
    )


def last_steps(session: Session, *, run_ids: Sequence[int]) -> dict[int, int]:
    """The highest step any rank of each run has reported a loss for."""
    if not run_ids:
        return {}
    rows = session.execute(
        select(RunMetric.run_id, func.max(RunMetric.step))
        .where(RunMetric.run_id.in_(list(run_ids)), RunMetric.name == "loss")
        .group_by(RunMetric.run_id)
    )
    return {int(r): int(s) for r, s in rows}


def link_bytes_until(session: Session, *, run_id: int, max_id: int) -> list[tuple[int, int, int]]:
    """Bytes sent per (rank, peer) link in the metric rows with id up to `max_id`."""
    rows = session.execute(
        select(RunMetric.rank, RunMetric.peer, func.sum(RunMetric.value))
        .where(RunMetric.run_id == run_id, RunMetric.name == "bytes_sent", RunMetric.peer >= 0, RunMetric.id <= max_id)
        .group_by(RunMetric.rank, RunMetric.peer)
    )
    return [(int(r), int(p), int(total or 0)) for r, p, total in rows]
