"""Runs as the pages show them: the overview's runs in flight and spend, the runs table, and a
run's charts and timeline of events as initial figures plus the state its live stream
continues from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.billing import Bill
from app.models import Run, RunEvent, RunMetric
from app.models.base import utcnow
from app.models.runs import ACTIVE_RUN_STATUSES
from app.queries import costs, dashboard
from app.queries.final_bills import spend_of_all_runs
from app.queries.metrics import metric_names
from app.queries.price_lookups import CachedPriceLookup, DbPriceLookup
from app.web import figures
from app.web.egress import LinkBucket, cumulative_by_class, link_rates
from app.web.live import LiveState, event_view, is_evaluation_metric
from hybridtrain.contract import is_local_sgd

# A chart of more points than a screen is wide shows nothing more and costs the browser time.
MAX_POINTS = 600
SERIES_NAMES = ("samples_per_s", "loss", "density", "batch_size", "outer_norm", "outer_staleness",
                "outer_deferred", "outer_folded", "outer_dropped")
# Byte counts are summed, not averaged, and feed the egress chart and the bill.
SUMMED_NAMES = ("bytes_sent",)
# A degraded or restarting run is still in flight: its page streams.
ACTIVE = tuple(sorted(ACTIVE_RUN_STATUSES))


@dataclass
class RunRow:
    """One run in a table: what it is, how far it got, and its spend so far."""

    id: int
    name: str
    status: str
    strategy: str
    task: str
    script: str | None
    workers: int
    step: int | None
    max_steps: int | None
    created_at: Any
    duration_s: float | None
    spend_usd: Decimal
    unpriced: bool

    @property
    def what(self) -> str:
        """What the run trains: its script, else its task."""
        return self.script or self.task

    @property
    def progress(self) -> float | None:
        if self.step is None or self.max_steps is None:
            return None
        return min(1.0, (self.step + 1) / max(1, self.max_steps))

    @property
    def progress_label(self) -> str:
        of = "?" if self.max_steps is None else self.max_steps
        # The trainer counts steps from 1: the last of 400 is step 400.
        return f"step {0 if self.step is None else self.step} of {of}"


@dataclass
class RunsOverview:
    """What the overview shows of runs: those in flight and the spend of all runs so far."""

    in_flight: list[RunRow] = field(default_factory=list)
    spend_usd: Decimal = Decimal(0)
    run_count: int = 0
    unpriced: bool = False


def run_rows(session: Session, runs: list[Run], *, bills: Mapping[int, Bill] | None = None) -> list[RunRow]:
    """Table rows of `runs` (one grouped query for their progress). An ended run's spend is its
    stored final bill; the others' are `bills`' or, failing that, billed together (`run_bills`)."""
    steps = dashboard.last_steps(session, run_ids=[r.id for r in runs])
    now = utcnow()
    known = dict(bills or {})
    known.update(costs.run_bills(session, [r for r in runs if r.billed_at is None and r.id not in known], now=now))
    rows = []
    for run in runs:
        spend, unpriced = _spend(run, known)
        start = run.started_at or run.launched_at
        rows.append(RunRow(
            id=run.id, name=run.name, status=str(run.status), strategy=run.strategy, task=run.task,
            script=run.script, workers=sum(1 for w in run.workers if w.role == "worker"),
            step=steps.get(run.id), max_steps=run.max_steps, created_at=run.created_at,
            duration_s=None if start is None else ((run.finished_at or now) - start).total_seconds(),
            spend_usd=spend, unpriced=unpriced,
        ))
    return rows


def _spend(run: Run, bills: Mapping[int, Bill]) -> tuple[Decimal, bool]:
    """A run's spend and whether part of it had no price: its stored final bill, else its live one."""
    if run.billed_at is not None:
        return run.billed_usd or Decimal(0), bool(run.billed_unpriced)
    bill = bills[run.id]
    return bill.total_usd, bool(bill.unpriced)


def overview(session: Session) -> RunsOverview:
    """Runs in flight and what every run has spent so far: ended runs' stored final bills, the
    others billed live (`final_bills.spend_of_all_runs`)."""
    spend = spend_of_all_runs(session, now=utcnow())
    # The runs in flight were billed with the rest: their rows reuse those bills.
    in_flight = run_rows(session, dashboard.active_runs(session), bills=spend.live)
    return RunsOverview(in_flight=in_flight, spend_usd=spend.usd, run_count=spend.runs, unpriced=spend.unpriced)


def run_t0(session: Session, run: Run) -> float:
    """Where a run's time axis starts: its start, else its first metric, else its creation."""
    if run.started_at is not None:
        return run.started_at.timestamp()
    first = session.scalar(select(func.min(RunMetric.t)).where(RunMetric.run_id == run.id))
    if first is not None:
        return float(first)
    return (run.launched_at or run.created_at).timestamp()


def server_ranks(run: Run) -> set[int]:
    """The parameter server's rank(s)."""
    return {w.rank for w in run.workers if w.role == "ps"}


def worker_ranks(run: Run) -> list[int]:
    """The ranks that train (not the parameter server)."""
    return [w.rank for w in run.workers if w.role == "worker"]


@dataclass
class RunSeries:
    """A run's series from one grouped scan: drawable series, link bytes and bill inputs."""

    series: list[figures.Series]
    link_buckets: list[LinkBucket]
    link_totals: dict[tuple[int, int], int]
    samples: int


def evaluation_names(session: Session, run: Run) -> list[str]:
    """The task's evaluation metrics the run reported (accuracy, val_loss, r2, ...), sorted."""
    return [n for n in metric_names(session, run_id=run.id) if is_evaluation_metric(n)]


def run_series(session: Session, run: Run, *, names: tuple[str, ...] = SERIES_NAMES, max_points: int = MAX_POINTS) -> RunSeries:
    """Every series of the run on one grid of at most `max_points` step buckets."""
    width = dashboard.bucket_width(run.max_steps or 0, max_points)
    rows = dashboard.run_series(session, run_id=run.id, names=(*names, *SUMMED_NAMES, "batch_size"), width=width)
    points: dict[tuple[str, int], list[figures.Point]] = {}
    buckets: list[LinkBucket] = []
    totals: dict[tuple[int, int], int] = {}
    samples = 0
    # Only workers' batches are samples: the server reports the global batch it aggregated.
    worker_ranks = {w.rank for w in run.workers if w.role == "worker"}
    for row in rows:
        if row.name == "bytes_sent":
            if row.peer >= 0 and row.total:
                buckets.append(LinkBucket(row.rank, row.peer, row.bucket, row.step, row.t, int(row.total)))
                totals[(row.rank, row.peer)] = totals.get((row.rank, row.peer), 0) + int(row.total)
            continue
        if row.name == "batch_size" and row.rank in worker_ranks:
            samples += int(row.total or 0)
        if row.name in names:
            points.setdefault((row.name, row.rank), []).append((row.step, row.t, row.mean))
    series = [figures.Series(name, rank, pts) for (name, rank), pts in points.items()]
    return RunSeries(series, buckets, totals, samples)


@dataclass
class RunCharts:
    """A run's six charts, its events, its bill so far, and what the live stream continues from."""

    figures: dict[str, figures.Figure]
    t0: float
    metrics_after: int
    logs_after: int
    bill: Any
    unpriced: list[str]
    # `app.web.live.event_view` dicts, oldest first, and the newest event's id for the stream.
    events: list[dict[str, Any]] = field(default_factory=list)
    events_after: int = 0
    # Bytes per (rank, peer) and each rank's billing site, for the prediction beside the bill.
    link_totals: dict[tuple[int, int], int] = field(default_factory=dict)
    sites: dict[int, Any] = field(default_factory=dict)


def run_charts(session: Session, run: Run) -> RunCharts:
    """The run's charts as of now, every series downsampled in the database."""
    # Only a run in flight is streamed; a finished one needs no cursor (and no scan for it).
    active = run.status in ACTIVE
    metrics_after = dashboard.max_metric_id(session, run_id=run.id) if active else 0
    logs_after = dashboard.max_log_id(session, run_id=run.id) if active else 0
    t0 = run_t0(session, run)
    reported = metric_names(session, run_id=run.id)
    eval_names = [n for n in reported if is_evaluation_metric(n)]
    # A run that has reported nothing yet (queued, launching) has no series or sums to scan.
    data = run_series(session, run, names=(*SERIES_NAMES, *eval_names)) if reported else RunSeries([], [], {}, 0)
    # One lookup for the links and the bill: each asks the same few prices for every pair of ranks.
    prices = CachedPriceLookup(DbPriceLookup(session))
    nodes = costs.run_nodes(session, run=run)
    sites = costs.run_sites_by_rank(session, run=run, nodes=nodes)
    rates, unpriced = link_rates(sites, prices, costs.run_priced_at(run))
    egress_series, _ = cumulative_by_class(data.link_buckets, rates)
    planned = {w.rank: w.batch_size for w in run.workers if w.role == "worker" and w.batch_size}
    servers = server_ranks(run)
    # Loaded with the run (`Run.events` is selectin), oldest first as list_events orders them.
    stored_events = list(run.events)
    events = [event_view(e, t0) for e in stored_events]
    charts = {
        "throughput": figures.throughput_figure(data.series, t0, servers=servers),
        "loss": figures.loss_figure(data.series, t0, servers=servers),
        "evaluation": figures.evaluation_figure(data.series, t0, eval_names),
        "compression": figures.compression_figure(data.series, t0, servers=servers,
                                                  outer_steps=is_local_sgd(run.strategy)),
        "egress": figures.egress_figure(egress_series, t0, unpriced=unpriced),
        "batch": figures.batch_figure(data.series, t0, planned, servers=servers, outer_steps=is_local_sgd(run.strategy),
                                      late_changes=(run.local_sgd or {}).get("asynchronous") is True),
    }
    charts = {key: figures.with_events(fig, events) for key, fig in charts.items()}
    bill = costs.run_bill(session, run=run, links=data.link_totals, samples=data.samples, prices=prices, nodes=nodes,
                          totals=None if reported else costs.MetricTotals())
    events_after = max((e.id for e in stored_events), default=0)
    return RunCharts(charts, t0, metrics_after, logs_after, bill, unpriced, events, events_after,
                     data.link_totals, sites)


def events_after(session: Session, *, run_id: int, after_id: int) -> list[RunEvent]:
    """The run's events with ids above `after_id` (the live stream's read; `app.web.live.EventFeed`)."""
    return list(session.scalars(
        select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.id > after_id).order_by(RunEvent.id)
    ))


def live_state(session: Session, run: Run, *, t0: float, metrics_after: int) -> LiveState:
    """The stream's starting state: link prices and the egress dollars up to `metrics_after`."""
    prices = CachedPriceLookup(DbPriceLookup(session))
    rates, _ = link_rates(costs.run_sites_by_rank(session, run=run), prices, costs.run_priced_at(run))
    buckets = [
        LinkBucket(rank, peer, 0, 0, 0.0, total)
        for rank, peer, total in dashboard.link_bytes_until(session, run_id=run.id, max_id=metrics_after)
    ]
    _, totals = cumulative_by_class(buckets, rates)
    return LiveState(
        t0=t0, worker_ranks=worker_ranks(run), server_ranks=server_ranks(run), link_rates=rates,
        egress_usd_by_class=totals, eval_names=evaluation_names(session, run),
    )
