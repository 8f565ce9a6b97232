"""Hand-computed bills of synthetic runs, and the rules for throughput and granularity.

Prices are Table 1's (seed 003) unless a test builds its own; a GB is 2**30 bytes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from app.billing import (
    Continent,
    Granularity,
    InstanceKey,
    InstancePrice,
    InvalidUsageError,
    LinkBytes,
    NodeUsage,
    PriceNotFoundError,
    PricingBasis,
    Provider,
    RunUsage,
    StaticPriceTable,
    TrafficClass,
    WorkerTime,
    compute_bill,
    egress_usd,
)

RUN_AT = datetime(2024, 6, 1, 12, 0, tzinfo=UTC)
GIB = 2**30
HOUR = 3600.0
NA, EU, OCE = "north_america", "europe", "oceania"


def usd(text: str) -> Decimal:
    return Decimal(text)


def by_class(bill, **expected: str) -> None:
    """Assert the per-class egress: the named classes at their amounts, every other class $0."""
    for cls in TrafficClass:
        assert bill.egress_by_class[cls] == Decimal(expected.get(cls.value, "0")), cls


def test_bill_of_a_run_in_one_zone(site, table1):
    zone = site("gcp", "us-central1", "us-central1-a", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("a", zone, HOUR, spot=True, instance_type="n1-standard-8", gpu_model="T4"),
            NodeUsage("b", zone, HOUR, spot=True, instance_type="n1-standard-8", gpu_model="T4"),
        ],
        links=[LinkBytes("a", "b", 10 * GIB), LinkBytes("b", "a", 10 * GIB)],
        samples=1_000_000,
        duration_s=HOUR,
    )

    bill = compute_bill(usage, table1)

    # Intra-zone traffic is free; 2 spot T4s at $0.180/h for an hour.
    assert bill.egress_usd == usd("0")
    assert bill.bytes_by_class[TrafficClass.intra_zone] == 20 * GIB
    assert bill.compute_usd == usd("0.36")
    assert bill.total_usd == usd("0.36")
    assert bill.usd_per_million_samples == usd("0.36")
    assert bill.samples_per_s == pytest.approx(1_000_000 / 3600)


def test_bill_of_two_regions_of_one_provider(site, table1):
    west = site("aws", "us-west-2", "us-west-2c", NA)
    east = site("aws", "us-east-1", "us-east-1a", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("w", west, HOUR / 2, instance_type="g4dn.2xlarge", gpu_model="T4"),
            NodeUsage("e", east, HOUR / 2, instance_type="g4dn.2xlarge", gpu_model="T4"),
        ],
        links=[LinkBytes("w", "e", 5 * GIB), LinkBytes("e", "w", 3 * GIB)],
    )

    bill = compute_bill(usage, table1)

    # 8 GiB at AWS's inter-region US $0.01; 2 on-demand T4s at $0.802/h for half an hour.
    by_class(bill, inter_region="0.08")
    assert [(link.scope, link.usd) for link in bill.egress_by_link] == [
        (Continent.north_america, usd("0.05")),
        (Continent.north_america, usd("0.03")),
    ]
    assert bill.compute_usd == usd("0.802")
    assert bill.total_usd == usd("0.882")


def test_bill_of_two_providers(site, table1):
    gcp = site("gcp", "us-west1", "us-west1-b", NA)
    azure = site("azure", "southcentralus", "1", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("g", gcp, 2 * HOUR, spot=True, instance_type="n1-standard-8", gpu_model="T4"),
            NodeUsage("z", azure, 2 * HOUR, spot=True, instance_type="Standard_NC8as_T4_v3", gpu_model="T4"),
        ],
        links=[LinkBytes("g", "z", 4 * GIB), LinkBytes("z", "g", 4 * GIB)],
    )

    bill = compute_bill(usage, table1)

    # Each sender pays its own internet rate: GCP $0.12 x 4, Azure $0.087 x 4.
    assert [(link.payer, link.usd) for link in bill.egress_by_link] == [
        (Provider.gcp, usd("0.48")),
        (Provider.azure, usd("0.348")),
    ]
    by_class(bill, internet="0.828")
    # Spot T4s for two hours: GCP 2 x $0.180, Azure 2 x $0.134.
    assert {n.name: n.usd for n in bill.compute_by_node} == {"g": usd("0.36"), "z": usd("0.268")}
    assert bill.total_usd == usd("1.456")


def test_bill_of_onprem_plus_cloud(site, table1):
    lab = site("onprem", None, None, EU, name="lab")
    gcp = site("gcp", "us-central1", "us-central1-a", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("rtx", lab, 2 * HOUR, amortised_usd_per_hour=Decimal("0.25")),
            NodeUsage("v100", gcp, 2 * HOUR, instance_type="n1-standard-8", gpu_model="T4"),
        ],
        links=[LinkBytes("rtx", "v100", 6 * GIB), LinkBytes("v100", "rtx", 6 * GIB)],
    )

    bill = compute_bill(usage, table1)

    # Out of on-prem is free; out of GCP to the internet is $0.12/GB.
    assert [(link.payer, link.usd) for link in bill.egress_by_link] == [
        (None, usd("0")),
        (Provider.gcp, usd("0.72")),
    ]
    assert bill.bytes_by_class[TrafficClass.internet] == 12 * GIB
    # 2 h amortised at $0.25/h, 2 h on-demand at $0.572/h.
    assert [(n.basis, n.usd) for n in bill.compute_by_node] == [
        (PricingBasis.amortised, usd("0.5")),
        (PricingBasis.on_demand, usd("1.144")),
    ]
    assert bill.total_usd == usd("2.364")


def test_bill_of_a_run_with_a_node_in_oceania(site, table1):
    us_a = site("gcp", "us-central1", "us-central1-a", NA)
    us_b = site("gcp", "us-central1", "us-central1-b", NA)
    aus = site("gcp", "australia-southeast1", "australia-southeast1-a", OCE)
    t4 = {"spot": True, "instance_type": "n1-standard-8", "gpu_model": "T4"}
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("us-a", us_a, HOUR, **t4),
            NodeUsage("us-b", us_b, HOUR, **t4),
            NodeUsage("aus", aus, HOUR, **t4),
        ],
        links=[
            LinkBytes("us-a", "aus", 2 * GIB),
            LinkBytes("aus", "us-a", 2 * GIB),
            LinkBytes("us-a", "us-b", 1 * GIB),
        ],
    )

    bill = compute_bill(usage, table1)

    # GCP's ANY-OCE $0.15 both ways (2 x 2 GiB), inter-zone $0.01 x 1 GiB; 3 spot T4s for an hour.
    by_class(bill, to_oceania="0.60", inter_zone="0.01")
    assert bill.egress_usd == usd("0.61")
    assert bill.compute_usd == usd("0.54")
    assert bill.total_usd == usd("1.15")


def test_spot_node_pays_the_spot_rate_and_others_on_demand(site, table1):
    zone = site("gcp", "us-central1", "a", NA)
    nodes = [
        NodeUsage("spot", zone, HOUR, spot=True, instance_type="n1-standard-8", gpu_model="T4"),
        NodeUsage("od", zone, HOUR, spot=False, instance_type="n1-standard-8", gpu_model="T4"),
    ]

    bill = compute_bill(RunUsage(priced_at=RUN_AT, nodes=nodes), table1)

    assert [(n.basis, n.usd_per_hour) for n in bill.compute_by_node] == [
        (PricingBasis.spot, usd("0.180")),
        (PricingBasis.on_demand, usd("0.572")),
    ]


def test_onprem_node_without_an_amortised_rate_costs_nothing(site, table1):
    lab = site("onprem", None, None, EU, name="lab")

    bill = compute_bill(RunUsage(priced_at=RUN_AT, nodes=[NodeUsage("rtx", lab, HOUR)]), table1)

    assert bill.total_usd == usd("0")


def test_egress_equals_bytes_times_rate_within_rounding(site, table1):
    us = site("gcp", "us-central1", "a", NA)
    eu = site("gcp", "europe-west1", "b", EU)
    n_bytes = 123_456_789_012
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("us", us, 0.0, instance_type="n1-standard-8", gpu_model="T4"),
            NodeUsage("eu", eu, 0.0, instance_type="n1-standard-8", gpu_model="T4"),
        ],
        links=[LinkBytes("us", "eu", n_bytes)],
    )

    bill = compute_bill(usage, table1)

    exact = Decimal(n_bytes) * Decimal("0.08") / GIB
    assert abs(bill.egress_usd - exact) <= Decimal("0.0000005")
    assert bill.egress_usd == egress_usd(n_bytes, Decimal("0.08")).quantize(Decimal("0.000001"))


def test_repeated_links_are_summed(site, table1):
    us_a = site("gcp", "us-central1", "a", NA)
    us_b = site("gcp", "us-central1", "b", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("a", us_a, 0.0, instance_type="n1-standard-8", gpu_model="T4"),
            NodeUsage("b", us_b, 0.0, instance_type="n1-standard-8", gpu_model="T4"),
        ],
        links=[LinkBytes("a", "b", GIB), LinkBytes("a", "b", 2 * GIB)],
    )

    bill = compute_bill(usage, table1)

    assert [(link.bytes, link.usd) for link in bill.egress_by_link] == [(3 * GIB, usd("0.03"))]


def test_a_later_price_edit_does_not_change_a_past_bill(site):
    zone = site("aws", "us-west-2", "a", NA)
    key = InstanceKey(Provider.aws, "us-west-2", "g4dn.2xlarge")
    prices = StaticPriceTable(
        instances=[
            (key, datetime(2024, 1, 1, tzinfo=UTC), InstancePrice(None, Decimal("0.802"))),
            (key, datetime(2024, 7, 1, tzinfo=UTC), InstancePrice(None, Decimal("1.000"))),
        ]
    )
    usage = RunUsage(
        priced_at=RUN_AT, nodes=[NodeUsage("n", zone, HOUR, instance_type="g4dn.2xlarge")]
    )

    assert compute_bill(usage, prices).compute_usd == usd("0.802")


def test_missing_egress_price_raises_naming_the_row(site):
    a = site("aws", "ap-southeast-1", "a", "asia")
    b = site("aws", "sa-east-1", "a", "south_america")
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[NodeUsage("a", a, 0.0, instance_type="x"), NodeUsage("b", b, 0.0)],
        links=[LinkBytes("a", "b", GIB)],
    )

    with pytest.raises(PriceNotFoundError, match=r"aws inter_continent \(asia\) egress"):
        compute_bill(usage, StaticPriceTable())


def test_non_strict_bill_counts_missing_prices_as_zero_and_lists_them(site, table1):
    a = site("aws", "sa-east-1", "a", "south_america")
    b = site("aws", "sa-east-2", "a", "south_america")
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[NodeUsage("a", a, HOUR, instance_type="p3.2xlarge"), NodeUsage("b", b, 0.0)],
        links=[LinkBytes("a", "b", GIB)],
    )

    bill = compute_bill(usage, table1, strict=False)

    assert bill.total_usd == usd("0")
    assert bill.unpriced == (
        "aws inter_region (south_america) egress",
        "aws p3.2xlarge in sa-east-1 (on_demand)",
        "node 'b' (a cloud node without an instance type)",
    )


def test_spot_node_without_a_spot_price_is_unpriced(site):
    zone = site("lambda", "us-west-1", "a", NA)
    key = InstanceKey(Provider.lambda_, "us-west-1", "gpu_1x_a10")
    prices = StaticPriceTable(
        instances=[(key, RUN_AT, InstancePrice(None, Decimal("0.60")))],
    )
    node = NodeUsage("a10", zone, HOUR, spot=True, instance_type="gpu_1x_a10")
    usage = RunUsage(priced_at=RUN_AT, nodes=[node])

    with pytest.raises(PriceNotFoundError, match=r"gpu_1x_a10 in us-west-1 \(spot\)"):
        compute_bill(usage, prices)


def test_lambda_egress_is_free(site, table1):
    west = site("lambda", "us-west-1", "a", NA)
    east = site("lambda", "us-east-1", "a", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[NodeUsage("w", west, 0.0), NodeUsage("e", east, 0.0)],
        links=[LinkBytes("w", "e", 7 * GIB)],
    )

    # Lambda's instances are not in Table 1; only the egress matters here.
    bill = compute_bill(usage, table1, strict=False)

    assert bill.egress_by_link[0].traffic_class is TrafficClass.inter_region
    assert bill.egress_usd == usd("0")
    assert not any("egress" in item for item in bill.unpriced)


def test_link_to_an_unknown_node_is_rejected(site, table1):
    zone = site("gcp", "us-central1", "a", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[NodeUsage("a", zone, 0.0, instance_type="n1-standard-8", gpu_model="T4")],
        links=[LinkBytes("a", "ghost", 1)],
    )

    with pytest.raises(InvalidUsageError, match="unknown node 'ghost'"):
        compute_bill(usage, table1)


def test_a_node_listed_twice_is_rejected(site, table1):
    zone = site("gcp", "us-central1", "a", NA)
    node = NodeUsage("a", zone, 0.0, instance_type="n1-standard-8", gpu_model="T4")

    with pytest.raises(InvalidUsageError, match="'a' appears twice"):
        compute_bill(RunUsage(priced_at=RUN_AT, nodes=[node, node]), table1)


def test_negative_bytes_are_rejected():
    with pytest.raises(InvalidUsageError, match=r"links\[a->b\].bytes must be >= 0"):
        LinkBytes("a", "b", -1)


def test_amortised_rate_on_a_cloud_node_is_rejected(site):
    with pytest.raises(InvalidUsageError, match="only on-prem nodes"):
        NodeUsage("g", site("gcp", "us-central1", "a", NA), HOUR, amortised_usd_per_hour=1)


def test_run_with_no_samples_has_no_cost_per_million_samples(site, table1):
    zone = site("gcp", "us-central1", "a", NA)
    usage = RunUsage(
        priced_at=RUN_AT,
        nodes=[
            NodeUsage("a", zone, HOUR, spot=True, instance_type="n1-standard-8", gpu_model="T4")
        ],
        samples=0,
        duration_s=HOUR,
    )

    bill = compute_bill(usage, table1)

    assert bill.total_usd == usd("0.18")
    assert bill.usd_per_million_samples is None
    assert bill.samples_per_s == 0.0


def test_run_of_zero_duration_has_no_throughput(site, table1):
    bill = compute_bill(RunUsage(priced_at=RUN_AT, nodes=[], samples=10), table1)

    assert bill.samples_per_s is None


def test_time_to_target_is_passed_through(table1):
    bill = compute_bill(RunUsage(priced_at=RUN_AT, nodes=[], time_to_target_s=812.5), table1)

    assert bill.time_to_target_s == 812.5


def test_overall_granularity_is_total_compute_over_total_communication(table1):
    workers = [WorkerTime("w1", 90.0, 10.0), WorkerTime("w2", 30.0, 30.0)]

    bill = compute_bill(RunUsage(priced_at=RUN_AT, nodes=[], workers=workers), table1)

    # (90 + 30) / (10 + 30) = 3, not the mean of the workers' 9 and 1.
    assert bill.granularity == Granularity(120.0, 40.0, 3.0)
    assert bill.granularity_by_worker == {
        "w1": Granularity(90.0, 10.0, 9.0),
        "w2": Granularity(30.0, 30.0, 1.0),
    }


def test_granularity_without_communication_is_none(table1):
    workers = [WorkerTime("solo", 50.0, 0.0), WorkerTime("idle", 0.0, 0.0)]

    bill = compute_bill(RunUsage(priced_at=RUN_AT, nodes=[], workers=workers), table1)

    assert bill.granularity == Granularity(50.0, 0.0, None)
    assert bill.granularity_by_worker["idle"] == Granularity(0.0, 0.0, None)


def test_repeated_worker_times_are_summed(table1):
    workers = [WorkerTime("w1", 1.0, 1.0), WorkerTime("w1", 3.0, 1.0)]

    bill = compute_bill(RunUsage(priced_at=RUN_AT, nodes=[], workers=workers), table1)

    assert bill.granularity_by_worker == {"w1": Granularity(4.0, 2.0, 2.0)}
