"""Egress spend of a run as the chart shows it: every rank-to-rank link priced with
`app.billing` (the bill's own classifier and formula), accumulated per traffic class.

The chart's cumulative figure after the last step is Σ bytes × rate / 2^30 over the links, the
exact sum `compute_bill` rounds once; so its last point equals the bill's `egress_by_class`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from app.billing import EgressKey, PriceLookup, Site, classify, egress_usd, round_usd
from app.web.figures import EgressSeries
from app.web.live import LinkRate


@dataclass(frozen=True)
class LinkBucket:
    """Bytes one rank sent another within one bucket of steps (ending at `step`, time `t`)."""

    rank: int
    peer: int
    bucket: int
    step: int
    t: float
    bytes: int


def link_rates(
    sites_by_rank: Mapping[int, Site], prices: PriceLookup, at: datetime
) -> tuple[dict[tuple[int, int], LinkRate], list[str]]:
    """The class and the sender's $/GB of every ordered pair of ranks, and what had no price.

    A link with no price in force counts at $0 and is named in the second list, as
    `compute_bill(strict=False)` does.
    """
    rates: dict[tuple[int, int], LinkRate] = {}
    unpriced: list[str] = []
    for src, src_site in sites_by_rank.items():
        for dst, dst_site in sites_by_rank.items():
            if src == dst:
                continue
            route = classify(src_site, dst_site)
            rate = Decimal(0)
            if route.payer is not None:
                key = EgressKey(route.payer, route.traffic_class, route.scope)
                found = prices.egress_usd_per_gb(key, at)
                if found is None:
                    if str(key) not in unpriced:
                        unpriced.append(str(key))
                else:
                    rate = found
            rates[(src, dst)] = LinkRate(str(route.traffic_class), rate)
    return rates, unpriced


def cumulative_by_class(
    buckets: Iterable[LinkBucket], rates: Mapping[tuple[int, int], LinkRate]
) -> tuple[list[EgressSeries], dict[str, Decimal]]:
    """Cumulative dollars per traffic class, one point per bucket, and the exact totals.

    Totals stay exact Decimals (the live stream continues from them); points are rounded to a
    micro-dollar, as every bill figure is.
    """
    by_bucket: dict[int, list[LinkBucket]] = {}
    for b in buckets:
        by_bucket.setdefault(b.bucket, []).append(b)
    totals: dict[str, Decimal] = {}
    series: dict[str, EgressSeries] = {}
    for index in sorted(by_bucket):
        group = by_bucket[index]
        touched: dict[str, tuple[int, float]] = {}
        for b in group:
            rate = rates.get((b.rank, b.peer))
            if rate is None:
                continue
            totals[rate.traffic_class] = totals.get(rate.traffic_class, Decimal(0)) + egress_usd(b.bytes, rate.usd_per_gb)
            step, t = touched.get(rate.traffic_class, (b.step, b.t))
            touched[rate.traffic_class] = (max(step, b.step), max(t, b.t))
        for cls, (step, t) in touched.items():
            series.setdefault(cls, EgressSeries(cls)).points.append((step, t, float(round_usd(totals[cls]))))
    return [series[c] for c in sorted(series)], totals


def sites_for_ranks(ranks: Sequence[tuple[int, Site | None]]) -> dict[int, Site]:
    """Ranks whose node (and so site) is still known."""
    return {rank: site for rank, site in ranks if site is not None}
