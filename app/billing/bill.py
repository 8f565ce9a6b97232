"""A run's bill from plain usage figures: egress and compute spend, throughput and granularity.

`compute_bill` is pure: it takes what a run used (`RunUsage`) and a `PriceLookup`, and returns a
`Bill`. Called on the figures so far it gives the live bill; on the final figures, the final one.
Amounts are exact Decimals until each reported figure is rounded once to a micro-dollar, so a
total can differ from the sum of its rounded parts by half a micro-dollar per part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from enum import StrEnum

from app.billing.errors import InvalidUsageError, PriceNotFoundError
from app.billing.prices import (
    EgressKey,
    InstanceKey,
    PriceLookup,
    compute_usd,
    egress_usd,
    round_usd,
)
from app.billing.traffic import Continent, Provider, Route, Site, SiteKind, TrafficClass, classify

_ZERO = Decimal(0)
# Called with a description of what has no price; returns the rate to use instead, or raises.
_Missing = Callable[[str], Decimal]


@dataclass(frozen=True)
class NodeUsage:
    """A node of the run: where it is, how long it was in the run, and how it is priced.

    Cloud nodes are priced from the lookup by instance type and GPUs, at the spot or on-demand
    rate by `spot`; on-prem nodes cost `amortised_usd_per_hour` (default 0), which cloud nodes
    may not carry. `share` is the run's part of the node (its GPUs over the node's, each
    divided by the runs sharing it): the run pays that part of the node's rate.
    """

    name: str
    site: Site
    seconds: float
    spot: bool = False
    instance_type: str | None = None
    gpu_model: str | None = None
    gpu_count: int = 1
    amortised_usd_per_hour: Decimal | None = None
    share: Decimal = Decimal(1)

    def __post_init__(self) -> None:
        _non_negative(f"nodes[{self.name}].seconds", self.seconds)
        object.__setattr__(self, "share", Decimal(str(self.share)))
        if not Decimal(0) < self.share <= Decimal(1):
            raise InvalidUsageError(
                f"nodes[{self.name}].share", f"nodes[{self.name}].share must be in (0, 1], got {self.share}"
            )
        if self.amortised_usd_per_hour is not None:
            if self.site.kind is not SiteKind.onprem:
                raise InvalidUsageError(
                    "amortised_usd_per_hour",
                    f"node {self.name!r} is in cloud site {self.site.name!r}: only on-prem "
                    "nodes carry an amortised $/h",
                )
            object.__setattr__(
                self, "amortised_usd_per_hour", Decimal(str(self.amortised_usd_per_hour))
            )
            _non_negative(f"nodes[{self.name}].amortised_usd_per_hour", self.amortised_usd_per_hour)


@dataclass(frozen=True)
class LinkBytes:
    """Bytes `src` sent to `dst` (node names); repeated pairs are summed."""

    src: str
    dst: str
    bytes: int

    def __post_init__(self) -> None:
        _non_negative(f"links[{self.src}->{self.dst}].bytes", self.bytes)


@dataclass(frozen=True)
class StoreRead:
    """Bytes node `node` read from a data set's store at `store` (priced as the store's egress)."""

    store: Site
    node: str
    bytes: int

    def __post_init__(self) -> None:
        _non_negative(f"reads[{self.store.name}->{self.node}].bytes", self.bytes)


@dataclass(frozen=True)
class WorkerTime:
    """A worker's seconds computing and communicating; repeated names are summed."""

    name: str
    compute_s: float
    comm_s: float

    def __post_init__(self) -> None:
        _non_negative(f"workers[{self.name}].compute_s", self.compute_s)
        _non_negative(f"workers[{self.name}].comm_s", self.comm_s)


@dataclass(frozen=True)
class RunUsage:
    """Everything a run used, as plain figures; `priced_at` picks the prices in force."""

    priced_at: datetime
    nodes: Sequence[NodeUsage]
    links: Sequence[LinkBytes] = ()
    workers: Sequence[WorkerTime] = ()
    # Data sets' bytes read from their stores (hybridtrain.datasets), priced like gradients.
    reads: Sequence[StoreRead] = ()
    samples: int = 0
    duration_s: float = 0.0
    time_to_target_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("nodes", "links", "workers", "reads"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        _non_negative("samples", self.samples)
        _non_negative("duration_s", self.duration_s)
        if self.time_to_target_s is not None:
            _non_negative("time_to_target_s", self.time_to_target_s)


class PricingBasis(StrEnum):
    spot = "spot"
    on_demand = "on_demand"
    amortised = "amortised"


@dataclass(frozen=True)
class LinkCost:
    """One directed link's bytes, how they were classed, and what the sender paid."""

    src: str
    dst: str
    bytes: int
    traffic_class: TrafficClass
    scope: Continent | None
    payer: Provider | None
    usd_per_gb: Decimal
    usd: Decimal


@dataclass(frozen=True)
class NodeCost:
    """One node's compute spend: its time in the run at the rate its basis gives."""

    name: str
    seconds: float
    basis: PricingBasis
    usd_per_hour: Decimal
    usd: Decimal
    # The run's part of the node that `usd` pays for (1: the whole node).
    share: Decimal = Decimal(1)


@dataclass(frozen=True)
class Granularity:
    """Compute seconds over communication seconds; `ratio` is None when nothing was communicated.

    With zero communication the ratio is unbounded (or, with zero compute too, undefined); the
    seconds stay here so a reader can tell the two apart.
    """

    compute_s: float
    comm_s: float
    ratio: float | None


@dataclass(frozen=True)
class Bill:
    """A run's cost and throughput. USD figures are rounded to a micro-dollar (see module doc)."""

    egress_usd: Decimal
    egress_by_class: Mapping[TrafficClass, Decimal]
    bytes_by_class: Mapping[TrafficClass, int]
    egress_by_link: tuple[LinkCost, ...]
    compute_usd: Decimal
    compute_by_node: tuple[NodeCost, ...]
    total_usd: Decimal
    samples: int
    usd_per_million_samples: Decimal | None
    samples_per_s: float | None
    time_to_target_s: float | None
    granularity: Granularity
    granularity_by_worker: Mapping[str, Granularity]
    # What had no price in force, when billed with strict=False (those items count as $0).
    unpriced: tuple[str, ...] = field(default=())
    # The part of the egress that is data sets' bytes read from their stores (`RunUsage.reads`).
    reads_usd: Decimal = Decimal(0)
    read_bytes: int = 0


def compute_bill(usage: RunUsage, prices: PriceLookup, *, strict: bool = True) -> Bill:
    """The bill of `usage` at the prices in force at `usage.priced_at`.

    A missing price raises `PriceNotFoundError`; with `strict=False` it counts as $0 and is
    listed in `Bill.unpriced`, so a live view of a half-priced setup still shows the rest.
    """
    sites = _sites_by_node(usage.nodes)
    unpriced: list[str] = []

    def missing(what: str) -> Decimal:
        if strict:
            raise PriceNotFoundError(what, usage.priced_at)
        if what not in unpriced:
            unpriced.append(what)
        return _ZERO

    links, egress_exact, egress_class_exact, bytes_by_class = _egress(
        usage, sites, prices, missing
    )
    stores = {read.store.name for read in usage.reads}
    reads = [link for link in links if link.src in stores]
    nodes, compute_exact = _compute(usage, prices, missing)
    total_exact = egress_exact + compute_exact
    per_million = total_exact * 1_000_000 / usage.samples if usage.samples else None
    overall, by_worker = granularity(usage.workers)
    return Bill(
        egress_usd=round_usd(egress_exact),
        egress_by_class={cls: round_usd(usd) for cls, usd in egress_class_exact.items()},
        bytes_by_class=bytes_by_class,
        egress_by_link=links,
        compute_usd=round_usd(compute_exact),
        compute_by_node=nodes,
        total_usd=round_usd(total_exact),
        samples=usage.samples,
        usd_per_million_samples=None if per_million is None else round_usd(per_million),
        samples_per_s=usage.samples / usage.duration_s if usage.duration_s else None,
        time_to_target_s=usage.time_to_target_s,
        granularity=overall,
        granularity_by_worker=by_worker,
        unpriced=tuple(unpriced),
        # From the exact amounts, rounded once as every total: a sum of the links' rounded
        # amounts drifts by up to half a micro-dollar a link.
        reads_usd=round_usd(sum((egress_usd(link.bytes, link.usd_per_gb) for link in reads), _ZERO)),
        read_bytes=sum(link.bytes for link in reads),
    )


def granularity(workers: Sequence[WorkerTime]) -> tuple[Granularity, dict[str, Granularity]]:
    """Overall granularity (total compute s / total comm s over all workers) and each worker's."""
    totals: dict[str, tuple[float, float]] = {}
    for w in workers:
        compute_s, comm_s = totals.get(w.name, (0.0, 0.0))
        totals[w.name] = (compute_s + w.compute_s, comm_s + w.comm_s)
    by_worker = {name: _ratio(c, m) for name, (c, m) in totals.items()}
    overall = _ratio(sum(c for c, _ in totals.values()), sum(m for _, m in totals.values()))
    return overall, by_worker


def _ratio(compute_s: float, comm_s: float) -> Granularity:
    return Granularity(compute_s, comm_s, compute_s / comm_s if comm_s > 0 else None)


def _sites_by_node(nodes: Sequence[NodeUsage]) -> dict[str, Site]:
    sites: dict[str, Site] = {}
    for node in nodes:
        if node.name in sites:
            raise InvalidUsageError("nodes", f"node {node.name!r} appears twice in the run")
        sites[node.name] = node.site
    return sites


def _egress(
    usage: RunUsage, sites: Mapping[str, Site], prices: PriceLookup, missing: _Missing
) -> tuple[tuple[LinkCost, ...], Decimal, dict[TrafficClass, Decimal], dict[TrafficClass, int]]:
    """Per-link costs, exact egress total, exact per-class totals and bytes per class."""
    summed: dict[tuple[str, str], int] = {}
    for link in usage.links:
        for end in (link.src, link.dst):
            if end not in sites:
                raise InvalidUsageError(
                    "links", f"link {link.src!r} -> {link.dst!r} names unknown node {end!r}"
                )
        summed[(link.src, link.dst)] = summed.get((link.src, link.dst), 0) + link.bytes

    rates: dict[EgressKey, Decimal] = {}
    by_class_usd = {cls: _ZERO for cls in TrafficClass}
    by_class_bytes = {cls: 0 for cls in TrafficClass}
    links: list[LinkCost] = []
    total = _ZERO
    for (src, dst), n_bytes in summed.items():
        route = classify(sites[src], sites[dst])
        rate = _egress_rate(route, prices, usage.priced_at, rates, missing)
        usd = egress_usd(n_bytes, rate)
        total += usd
        by_class_usd[route.traffic_class] += usd
        by_class_bytes[route.traffic_class] += n_bytes
        links.append(
            LinkCost(
                src=src,
                dst=dst,
                bytes=n_bytes,
                traffic_class=route.traffic_class,
                scope=route.scope,
                payer=route.payer,
                usd_per_gb=rate,
                usd=round_usd(usd),
            )
        )
    for cost, usd in _read_costs(usage.reads, sites, prices, usage.priced_at, rates, missing):
        total += usd
        by_class_usd[cost.traffic_class] += usd
        by_class_bytes[cost.traffic_class] += cost.bytes
        links.append(cost)
    return tuple(links), total, by_class_usd, by_class_bytes


def _read_costs(
    reads: Sequence[StoreRead], sites: Mapping[str, Site], prices: PriceLookup, at: datetime,
    rates: dict[EgressKey, Decimal], missing: _Missing,
) -> list[tuple[LinkCost, Decimal]]:
    """Each (store, node) pair's summed reads, priced as the store's egress to the node's site,
    with its exact dollars."""
    out = []
    for (store, node), n_bytes in _summed_reads(reads, sites).items():
        route = classify(store, sites[node])
        rate = _egress_rate(route, prices, at, rates, missing)
        usd = egress_usd(n_bytes, rate)
        out.append((LinkCost(src=store.name, dst=node, bytes=n_bytes, traffic_class=route.traffic_class,
                             scope=route.scope, payer=route.payer, usd_per_gb=rate, usd=round_usd(usd)), usd))
    return out


def price_reads(
    reads: Sequence[StoreRead], sites: Mapping[str, Site], prices: PriceLookup, at: datetime
) -> tuple[tuple[LinkCost, ...], tuple[str, ...]]:
    """Store reads alone priced as `compute_bill` prices them (`sites`: each reading node's site),
    with what had no price in force (counted as $0); for predictions of reads not yet made."""
    unpriced: list[str] = []

    def missing(what: str) -> Decimal:
        if what not in unpriced:
            unpriced.append(what)
        return _ZERO

    costs = _read_costs(reads, sites, prices, at, {}, missing)
    return tuple(cost for cost, _ in costs), tuple(unpriced)


def _summed_reads(reads: Sequence[StoreRead], sites: Mapping[str, Site]) -> dict[tuple[Site, str], int]:
    summed: dict[tuple[Site, str], int] = {}
    for read in reads:
        if read.node not in sites:
            raise InvalidUsageError("reads", f"a read from {read.store.name!r} names unknown node {read.node!r}")
        summed[(read.store, read.node)] = summed.get((read.store, read.node), 0) + read.bytes
    return summed


def _egress_rate(
    route: Route,
    prices: PriceLookup,
    at: datetime,
    cache: dict[EgressKey, Decimal],
    missing: _Missing,
) -> Decimal:
    # Ingress is free everywhere and on-prem uplinks are not metered: only a cloud sender pays.
    if route.payer is None:
        return _ZERO
    key = EgressKey(route.payer, route.traffic_class, route.scope)
    if key not in cache:
        rate = prices.egress_usd_per_gb(key, at)
        cache[key] = missing(str(key)) if rate is None else rate
    return cache[key]


def _compute(
    usage: RunUsage, prices: PriceLookup, missing: _Missing
) -> tuple[tuple[NodeCost, ...], Decimal]:
    costs: list[NodeCost] = []
    total = _ZERO
    for node in usage.nodes:
        basis, rate = _node_rate(node, prices, usage.priced_at, missing)
        usd = compute_usd(node.seconds, rate) * node.share
        total += usd
        costs.append(NodeCost(node.name, node.seconds, basis, rate, round_usd(usd), node.share))
    return tuple(costs), total


def _node_rate(
    node: NodeUsage, prices: PriceLookup, at: datetime, missing: _Missing
) -> tuple[PricingBasis, Decimal]:
    if node.site.kind is SiteKind.onprem:
        return PricingBasis.amortised, node.amortised_usd_per_hour or _ZERO
    basis = PricingBasis.spot if node.spot else PricingBasis.on_demand
    if node.instance_type is None:
        return basis, missing(f"node {node.name!r} (a cloud node without an instance type)")
    key = InstanceKey(
        node.site.provider, node.site.region, node.instance_type, node.gpu_model, node.gpu_count
    )
    price = prices.instance_price(key, at)
    rate = None if price is None else price.for_spot(node.spot)
    if rate is None:
        return basis, missing(f"{key} ({basis.value})")
    return basis, rate


def _non_negative(name: str, value: float | int | Decimal) -> None:
    # Written so that NaN fails too.
    if not value >= 0:
        raise InvalidUsageError(name, f"{name} must be >= 0, got {value!r}")
