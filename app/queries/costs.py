"""A run's bill from what the database holds: its plan, its nodes' sites and its metrics.

`app.billing` does the arithmetic on plain figures; this module gathers those figures (bytes
per link, each node's time in the run from its ranks and the run's membership events, compute
and communication seconds per worker) and
supplies the prices in force (`app.queries.price_lookups`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from app.billing import (
    MEMBERSHIP_KINDS,
    Bill,
    LinkBytes,
    MembershipChange,
    NodeUsage,
    PriceLookup,
    RunUsage,
    Site,
    SiteKind,
    StoreRead,
    WorkerTime,
    compute_bill,
    rank_spans,
    union_seconds,
)
from app.models import Dataset, Node, RunEvent
from app.models import Site as SiteRow
from app.models.runs import Run, RunMetric, RunWorker
from app.queries.price_lookups import CachedPriceLookup, DbPriceLookup, PriceHistoryLookup
from hybridtrain.contract import LEGACY_TIME_TO_TARGET


def billing_site(site: SiteRow) -> Site:
    """A stored site as `app.billing` classifies it.

    An on-prem site run by provider 'other' (a colocation) bills as on-prem: its uplink is not
    metered per byte, which is what `app.billing` means by an on-prem sender.
    """
    kind = SiteKind(site.kind)
    provider = "onprem" if kind is SiteKind.onprem else str(site.provider)
    return Site(site.name, kind.value, provider, str(site.continent), site.region, site.zone)


def run_priced_at(run: Run) -> datetime:
    """The instant whose prices bill a run: its start, else its launch or creation (docs/costs.md)."""
    return run.started_at or run.launched_at or run.created_at


def run_nodes(session: Session, *, run: Run) -> dict[int, Node]:
    """The run's nodes that still exist, by id, with their sites and GPUs: what its bill and
    its links' prices read (a page asks once and hands them to both)."""
    node_ids = {w.node_id for w in run.workers if w.node_id is not None}
    if not node_ids:
        return {}
    return {
        n.id: n
        for n in session.scalars(
            select(Node).where(Node.id.in_(node_ids)).options(selectinload(Node.site), selectinload(Node.gpus))
        )
    }


def run_sites_by_rank(session: Session, *, run: Run, nodes: dict[int, Node] | None = None) -> dict[int, Site]:
    """The billing site of every rank whose node still exists (`nodes`: `run_nodes`, if the caller has them)."""
    if nodes is None:
        nodes = run_nodes(session, run=run)
    return {
        w.rank: billing_site(nodes[w.node_id].site)
        for w in run.workers
        if w.node_id is not None and w.node_id in nodes
    }


def dataset_store_site(dataset: Dataset) -> Site:
    """Where a data set's store is, as `app.billing` classes the bytes read from it."""
    provider = str(dataset.store_provider)
    kind = SiteKind.onprem if provider == "onprem" else SiteKind.cloud
    return Site(f"store of {dataset.name}", kind.value, provider, str(dataset.store_continent),
                dataset.store_region, dataset.store_zone)


def store_reads(
    session: Session, *, reads: dict[tuple[int, int], int], node_by_rank: dict[int, str]
) -> list[StoreRead]:
    """Bytes each node of the run read from each data set's store (`reads`: `data_bytes` summed
    per rank and data set id, from `MetricTotals`); reads of a data set deleted since are not priced."""
    ids = {dataset_id for _, dataset_id in reads}
    datasets = {d.id: d for d in session.scalars(select(Dataset).where(Dataset.id.in_(ids)))} if ids else {}
    return [
        StoreRead(dataset_store_site(datasets[dataset_id]), node_by_rank[rank], total)
        for (rank, dataset_id), total in reads.items()
        if dataset_id in datasets and rank in node_by_rank and total
    ]


# Summed into a bill: per rank (compute, communication, samples), per link (bytes), per store read.
_SUMMED_PER_RANK = ("compute_s", "comm_s", "batch_size")
_TIME_TO_TARGET = ("time_to_target_s", LEGACY_TIME_TO_TARGET)  # runs stored before task metrics: the legacy name
# Every metric a bill reads: a record of another name (a loss) leaves the bill as it was.
BILLED_METRICS = frozenset((*_SUMMED_PER_RANK, *_TIME_TO_TARGET, "bytes_sent", "data_bytes"))


@dataclass
class MetricTotals:
    """What a bill sums from a run's metrics, read in one grouped scan (`metric_totals`)."""

    by_rank: defaultdict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    links: dict[tuple[int, int], int] = field(default_factory=dict)
    reads: dict[tuple[int, int], int] = field(default_factory=dict)
    time_to_target_s: float | None = None


# Runs per query where many are read at once: far below any database's bound on parameters.
_IDS_PER_QUERY = 1000


def id_chunks(ids: Sequence[int]) -> list[list[int]]:
    """`ids` sorted, without repeats, in lists of at most a thousand (one query each)."""
    ids = sorted(set(ids))
    return [ids[i:i + _IDS_PER_QUERY] for i in range(0, len(ids), _IDS_PER_QUERY)]


def metric_totals(session: Session, *, run_id: int) -> MetricTotals:
    """The run's sums per rank, bytes per link and per store read, and its time to target, in
    one query (they were four, on every bill of a run list)."""
    return metric_totals_of(session, run_ids=[run_id]).get(run_id, MetricTotals())


def metric_totals_of(session: Session, *, run_ids: Sequence[int]) -> dict[int, MetricTotals]:
    """`metric_totals` of many runs, in one grouped query per thousand runs."""
    names = sorted(BILLED_METRICS)
    result: dict[int, MetricTotals] = {}
    for chunk in id_chunks(run_ids):
        rows = session.execute(
            select(RunMetric.run_id, RunMetric.rank, RunMetric.name, RunMetric.peer, func.sum(RunMetric.value),
                   func.min(RunMetric.value))
            .where(RunMetric.run_id.in_(chunk), RunMetric.name.in_(names))
            .group_by(RunMetric.run_id, RunMetric.rank, RunMetric.name, RunMetric.peer)
        )
        for run_id, rank, name, peer, total, least in rows:
            totals = result.setdefault(run_id, MetricTotals())
            if name in _SUMMED_PER_RANK:
                sums = totals.by_rank[rank]
                sums[name] = sums.get(name, 0.0) + float(total or 0.0)
            elif name in _TIME_TO_TARGET:
                if least is not None and (totals.time_to_target_s is None or least < totals.time_to_target_s):
                    totals.time_to_target_s = float(least)
            elif name == "bytes_sent":
                if peer >= 0:
                    totals.links[(int(rank), int(peer))] = int(total or 0)
            else:
                totals.reads[(int(rank), int(peer))] = int(total or 0)
    return result


def worker_label(worker: RunWorker) -> str:
    """How a rank is named in a bill: its rank, role and node."""
    return f"rank {worker.rank} {worker.role} on {worker.node_name}"


def run_usage(
    session: Session,
    *,
    run: Run,
    now: datetime | None = None,
    links: dict[tuple[int, int], int] | None = None,
    samples: int | None = None,
    nodes: dict[int, Node] | None = None,
    totals: MetricTotals | None = None,
    changes: dict[int, list[MembershipChange]] | None = None,
) -> RunUsage:
    """Everything `run` used so far, from its plan and metrics (live until it finishes).

    A caller that has already summed the bytes per (rank, peer) or the samples, loaded the run's
    nodes (`run_nodes`), its metric totals or its membership changes passes them in to save the scan.
    """
    now = now or datetime.now(UTC)
    end = run.finished_at or now
    workers = list(run.workers)
    if changes is None:
        changes = membership_changes_of(session, run_ids=[run.id]).get(run.id, {})
    if nodes is None:
        nodes = run_nodes(session, run=run)
    usages = _node_usages(run, nodes, changes, run.started_at or run.launched_at, end)
    # The names the nodes' usages go by: a node renamed since the run is billed, links and reads
    # included, under its name now (as it is priced by its site and GPUs now).
    node_by_rank = {w.rank: nodes[w.node_id].name for w in workers if w.node_id in nodes}
    if totals is None:
        totals = metric_totals(session, run_id=run.id)
    sums = totals.by_rank
    if links is None:
        links = totals.links
    worker_ranks = [w for w in workers if w.role == "worker"]
    if samples is None:
        # Only workers' batches are samples: the server reports the global batch it aggregated.
        samples = int(sum(sums[w.rank].get("batch_size", 0.0) for w in worker_ranks))
    started = run.started_at or run.launched_at
    return RunUsage(
        priced_at=run_priced_at(run),
        nodes=usages,
        links=[
            LinkBytes(node_by_rank[rank], node_by_rank[peer], total)
            for (rank, peer), total in links.items()
            if rank in node_by_rank and peer in node_by_rank and total
        ],
        reads=store_reads(session, reads=totals.reads, node_by_rank=node_by_rank),
        workers=[
            WorkerTime(
                worker_label(w),
                sums[w.rank].get("compute_s", 0.0),
                sums[w.rank].get("comm_s", 0.0),
            )
            for w in worker_ranks
        ],
        samples=samples,
        duration_s=max(0.0, (end - started).total_seconds()) if started else 0.0,
        time_to_target_s=totals.time_to_target_s,
    )


def run_bill(
    session: Session,
    *,
    run: Run,
    now: datetime | None = None,
    links: dict[tuple[int, int], int] | None = None,
    samples: int | None = None,
    prices: PriceLookup | None = None,
    nodes: dict[int, Node] | None = None,
    totals: MetricTotals | None = None,
) -> Bill:
    """The bill of `run` so far at the prices in force at its start; unpriced items count as $0.
    `prices`: a lookup the caller shares with its other pricing (one query per key and instant);
    the rest as `run_usage` takes them."""
    usage = run_usage(session, run=run, now=now, links=links, samples=samples, nodes=nodes, totals=totals)
    # strict=False: a live view must not fail for one missing price; the bill lists it instead.
    return compute_bill(usage, prices or CachedPriceLookup(DbPriceLookup(session)), strict=False)


def run_bills(session: Session, runs: Sequence[Run], *, now: datetime | None = None) -> dict[int, Bill]:
    """`run_bill` of many runs (a run list, the overview's spend) in a few queries whatever their
    number: their nodes, metric totals and membership changes read together, and each price
    series once (`PriceHistoryLookup`) however many runs' starts it prices."""
    now = now or datetime.now(UTC)
    run_ids = [run.id for run in runs]
    node_ids = [w.node_id for run in runs for w in run.workers if w.node_id is not None]
    nodes: dict[int, Node] = {}
    for chunk in id_chunks(node_ids):
        nodes.update((n.id, n) for n in session.scalars(
            select(Node).where(Node.id.in_(chunk)).options(selectinload(Node.site), selectinload(Node.gpus))))
    totals = metric_totals_of(session, run_ids=run_ids)
    changes = membership_changes_of(session, run_ids=run_ids)
    prices = PriceHistoryLookup(session)
    return {
        run.id: compute_bill(run_usage(session, run=run, now=now, nodes=nodes, totals=totals.get(run.id, MetricTotals()),
                                       changes=changes.get(run.id, {})), prices, strict=False)
        for run in runs
    }


def _node_usages(
    run: Run, nodes: dict[int, Node], changes: dict[int, list[MembershipChange]],
    run_start: datetime | None, end: datetime,
) -> list[NodeUsage]:
    """Each node's time in the run: the union of its ranks' spans of membership, each from the
    rank's start (or its join) to its loss, leave or end (app.billing.membership).

    A node none of whose ranks reported a start is held for the run's whole span: it was
    reserved for the run whether or not its process came up.
    """
    workers = list(run.workers)
    spans: dict[int, list[tuple[datetime, datetime]]] = {}
    came_up: set[int] = set()  # nodes with a rank that started or joined
    for w in workers:
        if w.node_id is None:
            continue  # the node was deleted since: nothing left to price it by
        node_spans = spans.setdefault(w.node_id, [])
        if w.started_at is not None or w.rank in changes:
            came_up.add(w.node_id)
            node_spans.extend(rank_spans(w.started_at, w.finished_at, changes.get(w.rank, ()), end=end))
    usages = []
    for node in (nodes[node_id] for node_id in sorted(spans) if node_id in nodes):
        if node.id in came_up:
            seconds = union_seconds(spans[node.id])
        else:
            seconds = max(0.0, (end - run_start).total_seconds()) if run_start else 0.0
        ranks = [w for w in workers if w.node_id == node.id]
        usages.append(node_usage(node, seconds, share=node_share(node, ranks)))
    return usages


def node_share(node: Node, ranks: Sequence[RunWorker]) -> Fraction:
    """The part of `node` a run pays for: each GPU its `ranks` hold, divided by the runs that
    held it at launch, over the node's GPUs. A run holding none of them (a PS server, a node
    without GPUs) pays the whole node: nothing else is billed for what it uses there."""
    total = sum(g.count for g in node.gpus)
    held = {w.gpu_index: max(1, w.sharers or 1) for w in ranks if w.gpu_index is not None}
    if not total or not held:
        return Fraction(1)
    return min(Fraction(1), sum((Fraction(1, n) for n in held.values()), Fraction(0)) / total)


def membership_changes_of(session: Session, *, run_ids: Sequence[int]) -> dict[int, dict[int, list[MembershipChange]]]:
    """Each run's joins, leaves and losses per rank, oldest first (app.billing.membership)."""
    result: dict[int, dict[int, list[MembershipChange]]] = {}
    for chunk in id_chunks(run_ids):
        rows = session.execute(
            select(RunEvent.run_id, RunEvent.subject, RunEvent.t, RunEvent.kind)
            .where(RunEvent.run_id.in_(chunk), RunEvent.kind.in_(MEMBERSHIP_KINDS), RunEvent.subject.is_not(None))
            .order_by(RunEvent.t, RunEvent.id)
        )
        for run_id, subject, t, kind in rows:
            result.setdefault(run_id, {}).setdefault(int(subject), []).append(MembershipChange(t, kind))
    return result


def node_usage(node: Node, seconds: float, *, share: Fraction = Fraction(1)) -> NodeUsage:
    """How `app.billing` prices `node` for `seconds` (its site, GPU, spot or amortised rate),
    of which the run pays `share`; the node must be loaded with its site and GPUs."""
    site = billing_site(node.site)
    onprem = site.kind is SiteKind.onprem
    # An instance is priced by its one kind of GPU; a mixed node is priced by instance type only.
    gpu = node.gpus[0] if len(node.gpus) == 1 else None
    return NodeUsage(
        name=node.name,
        site=site,
        seconds=seconds,
        spot=node.spot,
        instance_type=None if onprem else node.instance_type,
        gpu_model=gpu.gpu_model.name if gpu else None,
        gpu_count=gpu.count if gpu else 1,
        amortised_usd_per_hour=Decimal(str(node.amortised_usd_per_h)) if onprem else None,
        share=Decimal(share.numerator) / Decimal(share.denominator),
    )
