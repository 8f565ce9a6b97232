"""Seed 003's Table 1 ("Average us-west cloud pricing in April '23") as data, plus the few rows
the paper implies but does not tabulate, each marked with where it comes from.

The tests price synthetic runs with these rows; a test checks that the database seed
(migration 0002, frozen like every migration) holds the same figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from app.billing.prices import EgressKey, InstanceKey, InstancePrice, StaticPriceTable
from app.billing.traffic import Continent, Provider, TrafficClass

# "April '23": the prices take effect at the start of that month.
TABLE1_EFFECTIVE = datetime(2023, 4, 1, tzinfo=UTC)
SOURCE = "seed 003 (Erben et al., PVLDB 17(6) 2024), Table 1, April 2023"

_GCP, _AWS, _AZURE = Provider.gcp, Provider.aws, Provider.azure


@dataclass(frozen=True)
class EgressRow:
    """One seeded egress rate, with the Table 1 row it reproduces or the reason it exists."""

    key: EgressKey
    usd_per_gb: Decimal
    source: str


def _row(
    label: str, cls: TrafficClass, scope: Continent | None, gc: str, aws: str, az: str
) -> list[EgressRow]:
    return [
        EgressRow(EgressKey(p, cls, scope), Decimal(v), f"Table 1: {label}")
        for p, v in ((_GCP, gc), (_AWS, aws), (_AZURE, az))
    ]


_US, _EU, _ASIA, _OCE = (
    Continent.north_america,
    Continent.europe,
    Continent.asia,
    Continent.oceania,
)
_IR, _OCE_ANY, _CONT = (
    TrafficClass.inter_region,
    TrafficClass.to_oceania,
    TrafficClass.inter_continent,
)

# Every traffic row of Table 1, in its order: GC, AWS, Azure.
TABLE1_EGRESS: tuple[EgressRow, ...] = tuple(
    _row("Traffic (inter-zone)", TrafficClass.inter_zone, None, "0.01", "0.01", "0.00")
    + _row("Traffic (inter-region) US", _IR, _US, "0.01", "0.01", "0.02")
    + _row("Traffic (inter-region) EU", _IR, _EU, "0.02", "0.01", "0.02")
    + _row("Traffic (inter-region) ASIA", _IR, _ASIA, "0.05", "0.01", "0.08")
    + _row("Traffic (inter-region) OCE", _IR, _OCE, "0.08", "0.01", "0.08")
    + _row("Traffic ANY-OCE", _OCE_ANY, None, "0.15", "0.02", "0.08")
    + _row("Traffic (between continents)", _CONT, None, "0.08", "0.02", "0.02")
)

_IMPLIED_INTRA_ZONE = (
    "not in Table 1: traffic within a zone is free at GC, AWS and Azure (Section 5 (2) calls it "
    "intra-zone and charges only inter-zone and farther)"
)
# Table 1 has no internet row; the seed (migration 0002) takes each provider's public list price
# for the first tier to North America, which is what a cloud bills for bytes leaving to an
# on-prem room or another provider. tests/app/test_run_costs.py keeps the two in step.
_IMPLIED_INTERNET = (
    "not in Table 1: the provider's public list price for internet egress (first tier, to "
    "North America), as seeded by migration 0002"
)
_IMPLIED_LAMBDA = "not in Table 1: 'LambdaLabs does not charge for any data egress' (Section 6)"

# Rows the paper implies, so that a run on any of its setups is fully priced.
IMPLIED_EGRESS: tuple[EgressRow, ...] = (
    tuple(
        EgressRow(EgressKey(p, TrafficClass.intra_zone), Decimal("0.00"), _IMPLIED_INTRA_ZONE)
        for p in (_GCP, _AWS, _AZURE)
    )
    + tuple(
        EgressRow(EgressKey(p, TrafficClass.internet), Decimal(v), _IMPLIED_INTERNET)
        for p, v in ((_GCP, "0.12"), (_AWS, "0.09"), (_AZURE, "0.087"))
    )
    + tuple(
        EgressRow(EgressKey(Provider.lambda_, cls, scope), Decimal("0.00"), _IMPLIED_LAMBDA)
        for cls in TrafficClass
        for scope in (list(Continent) if cls is TrafficClass.inter_region else [None])
    )
)

# T4 instance prices of Table 1 (one T4 each), with the instance type the paper rented.
TABLE1_T4: dict[Provider, tuple[str, InstancePrice]] = {
    _GCP: ("n1-standard-8", InstancePrice(Decimal("0.180"), Decimal("0.572"))),
    _AWS: ("g4dn.2xlarge", InstancePrice(Decimal("0.395"), Decimal("0.802"))),
    _AZURE: ("Standard_NC8as_T4_v3", InstancePrice(Decimal("0.134"), Decimal("0.489"))),
}


def table1_price_table(regions: dict[Provider, list[str]] | None = None) -> StaticPriceTable:
    """Table 1 (and the implied rows) as a price table; T4 prices are keyed in `regions`."""
    instances = [
        (InstanceKey(provider, region, instance_type, "T4", 1), TABLE1_EFFECTIVE, price)
        for provider, (instance_type, price) in TABLE1_T4.items()
        for region in (regions or {}).get(provider, [])
    ]
    return StaticPriceTable(
        egress=[
            (row.key, TABLE1_EFFECTIVE, row.usd_per_gb) for row in TABLE1_EGRESS + IMPLIED_EGRESS
        ],
        instances=instances,
    )
