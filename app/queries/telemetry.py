"""What `GET /metrics` reads from the database when it is scraped: runs and nodes by state,
and the latest training figures of the runs that are live.

Every read here runs on each scrape (every 15-60 s), so each is a grouped count over an
indexed column or an index seek per live rank; only the bytes and the bill of a live run sum
its byte records, as its cost page does.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from app.errors import HybridtrainError
from app.models import Node, NodeStatus, Run, RunMetric, RunStatus, RunWorker, WorkerStatus
from app.queries.costs import metric_totals, run_bill
from app.queries.metrics import NO_PEER

logger = logging.getLogger(__name__)

# Runs whose ranks may be training now; queued ones have not started and finished ones are
# history (their figures stay on their pages and in the runs-by-state counts).
LIVE_RUN_STATUSES = (
    RunStatus.launching, RunStatus.running, RunStatus.degraded, RunStatus.restarting,
)
# The states whose runs wait for their launch to complete: the launch queue.
LAUNCH_QUEUE_STATUSES = (RunStatus.queued, RunStatus.launching)


@dataclass(frozen=True)
class RankFigures:
    """The latest step one running rank reported: its throughput and how long the step took."""

    run_id: int
    rank: int
    role: str
    node: str
    samples_per_s: float | None
    step_s: float | None


@dataclass(frozen=True)
class LiveRun:
    """A live run's totals so far: bytes sent per (src node, dst node) and its bill (None
    when its figures cannot be billed, e.g. a negative byte count from a faulty rank)."""

    run_id: int
    name: str
    strategy: str
    link_bytes: dict[tuple[str, str], int]
    egress_usd: Decimal | None
    compute_usd: Decimal | None


def runs_by_status(session: Session) -> dict[RunStatus, int]:
    """How many runs are in each state (every state present, 0 when none)."""
    rows = session.execute(select(Run.status, func.count()).group_by(Run.status))
    counts = dict.fromkeys(RunStatus, 0)
    counts.update({RunStatus(status): int(n) for status, n in rows})
    return counts


def nodes_by_status(session: Session) -> dict[NodeStatus, int]:
    """How many nodes are in each state (every state present, 0 when none)."""
    rows = session.execute(select(Node.status, func.count()).group_by(Node.status))
    counts = dict.fromkeys(NodeStatus, 0)
    counts.update({NodeStatus(status): int(n) for status, n in rows})
    return counts


@dataclass(frozen=True)
class GpuFigures:
    """One GPU of a live node as its agent's NVML last read it."""

    node: str
    gpu: int
    model: str
    utilization: float
    memory_used_bytes: int
    memory_total_bytes: int


def live_gpu_figures(session: Session) -> list[GpuFigures]:
    """The GPUs of nodes whose agent is alive (online or draining) and reports NVML readings;
    an offline node's last readings are stale and left out."""
    rows = session.execute(
        select(Node.name, Node.gpu_usage)
        .where(Node.status.in_((NodeStatus.online, NodeStatus.draining)), Node.gpu_usage.is_not(None))
        .order_by(Node.name)
    )
    return [
        GpuFigures(node=name, gpu=int(gpu["index"]), model=str(gpu.get("name", "")),
                   utilization=float(gpu["utilization"]), memory_used_bytes=int(gpu["memory_used_bytes"]),
                   memory_total_bytes=int(gpu["memory_total_bytes"]))
        for name, usage in rows for gpu in usage or []
    ]


def _latest_value(name: str):  # type: ignore[no-untyped-def]
    # Rides ix_run_metrics_series (run_id, name, rank, peer, step) backwards: one seek per rank.
    # A step trained again after a restart is told apart by its later id.
    return (
        select(RunMetric.value)
        .where(
            RunMetric.run_id == RunWorker.run_id,
            RunMetric.rank == RunWorker.rank,
            RunMetric.name == name,
            RunMetric.peer == NO_PEER,
        )
        .order_by(RunMetric.step.desc(), RunMetric.id.desc())
        .limit(1)
        .correlate(RunWorker)
        .scalar_subquery()
    )


def running_rank_figures(session: Session) -> list[RankFigures]:
    """Samples/s and step time of every running rank of a live run, from its latest step.

    The step time is the step's batch over its samples/s: both come from the same record of
    the trainer, so it is the wall time of that step, whatever the strategy.
    """
    rows = session.execute(
        select(
            RunWorker.run_id, RunWorker.rank, RunWorker.role, RunWorker.node_name,
            _latest_value("samples_per_s"), _latest_value("batch_size"),
        )
        .join(Run, Run.id == RunWorker.run_id)
        .where(Run.status.in_(LIVE_RUN_STATUSES), RunWorker.status == WorkerStatus.running)
        .order_by(RunWorker.run_id, RunWorker.rank)
    )
    figures = []
    for run_id, rank, role, node, samples_per_s, batch in rows:
        step_s = batch / samples_per_s if batch and samples_per_s else None
        figures.append(RankFigures(run_id, rank, role, node, samples_per_s, step_s))
    return figures


def live_runs(session: Session) -> list[LiveRun]:
    """Every live run's bytes by node pair and its egress and compute $ so far."""
    runs = session.scalars(
        select(Run)
        .where(Run.status.in_(LIVE_RUN_STATUSES))
        .options(selectinload(Run.workers))
        .order_by(Run.id)
    ).all()
    result = []
    for run in runs:
        totals = metric_totals(session, run_id=run.id)
        links = totals.links
        node_by_rank = {w.rank: w.node_name for w in run.workers}
        by_nodes: defaultdict[tuple[str, str], int] = defaultdict(int)
        for (rank, peer), total in links.items():
            if rank in node_by_rank and peer in node_by_rank:
                by_nodes[(node_by_rank[rank], node_by_rank[peer])] += total
        try:
            bill = run_bill(session, run=run, totals=totals)
        except HybridtrainError as exc:
            # One run's bad figures must not take every other series out of the scrape.
            logger.warning("run %d cannot be billed for /metrics: %s", run.id, exc.message)
            result.append(LiveRun(run.id, run.name, run.strategy, dict(by_nodes), None, None))
            continue
        result.append(LiveRun(
            run.id, run.name, run.strategy, dict(by_nodes), bill.egress_usd, bill.compute_usd,
        ))
    return result
