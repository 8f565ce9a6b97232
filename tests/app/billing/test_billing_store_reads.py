"""Bytes read from a data set's store, priced by traffic class at the gradient traffic's rates
(hand-computed; a GB is 2**30 bytes)."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from app.billing import (
    EgressKey,
    InvalidUsageError,
    NodeUsage,
    Provider,
    RunUsage,
    Site,
    StaticPriceTable,
    StoreRead,
    TrafficClass,
)
from app.billing import compute_bill as bill_of

AT = datetime(2026, 1, 1, tzinfo=UTC)
GIB = 2**30
STORE = Site("store", "cloud", "aws", "north_america", "us-east-1", "us-east-1a")
SAME_REGION = Site("aws-east", "cloud", "aws", "north_america", "us-east-1", "us-east-1b")
OTHER_REGION = Site("aws-west", "cloud", "aws", "north_america", "us-west-2", "us-west-2a")
ONPREM = Site("lab", "onprem", "onprem", "europe")
PRICES = StaticPriceTable(egress=[
    (EgressKey(Provider.aws, TrafficClass.inter_zone), AT, Decimal("0.01")),
    (EgressKey(Provider.aws, TrafficClass.inter_region), AT, Decimal("0.02")),
    (EgressKey(Provider.aws, TrafficClass.internet), AT, Decimal("0.09")),
])


def _usage(*reads: StoreRead) -> RunUsage:
    nodes = [NodeUsage(site.name, site, 0.0, instance_type="g5.xlarge") for site in (SAME_REGION, OTHER_REGION)]
    nodes.append(NodeUsage("lab", ONPREM, 0.0))
    return RunUsage(priced_at=AT, nodes=nodes, reads=reads)


def compute_bill(usage, prices):
    # The nodes' own prices are beside the point here: only the reads' egress is checked.
    return bill_of(usage, prices, strict=False)


def test_reads_are_priced_by_how_far_the_store_is_from_each_node():
    bill = compute_bill(_usage(StoreRead(STORE, "aws-east", 4 * GIB), StoreRead(STORE, "aws-west", 3 * GIB),
                               StoreRead(STORE, "lab", 2 * GIB)), PRICES)
    # 4 GB inter-zone at $0.01 + 3 GB inter-region at $0.02 + 2 GB out to the internet at $0.09.
    assert bill.egress_usd == Decimal("0.04") + Decimal("0.06") + Decimal("0.18")
    assert bill.bytes_by_class[TrafficClass.internet] == 2 * GIB
    assert {(c.src, c.dst, c.traffic_class) for c in bill.egress_by_link} == {
        ("store", "aws-east", TrafficClass.inter_zone), ("store", "aws-west", TrafficClass.inter_region),
        ("store", "lab", TrafficClass.internet)}


def test_the_bill_names_the_part_of_its_egress_that_is_data_reads():
    bill = compute_bill(_usage(StoreRead(STORE, "lab", 2 * GIB)), PRICES)
    assert (bill.reads_usd, bill.read_bytes) == (Decimal("0.18"), 2 * GIB)


def test_the_data_reads_total_is_rounded_once_from_the_exact_amounts():
    # 0.400002 micro-dollars a node: each link rounds to $0, their exact sum to $0.000001.
    bill = compute_bill(_usage(StoreRead(STORE, "aws-east", 42950), StoreRead(STORE, "aws-west", 21475)), PRICES)
    assert [c.usd for c in bill.egress_by_link] == [0, 0]
    assert bill.reads_usd == bill.egress_usd == Decimal("0.000001")


def test_reads_of_one_node_from_one_store_are_summed():
    bill = compute_bill(_usage(StoreRead(STORE, "lab", GIB), StoreRead(STORE, "lab", GIB)), PRICES)
    assert [c.bytes for c in bill.egress_by_link] == [2 * GIB]


def test_a_store_on_prem_is_not_billed_per_byte():
    lab_store = Site("nas", "onprem", "onprem", "europe")
    assert compute_bill(_usage(StoreRead(lab_store, "aws-east", 5 * GIB)), PRICES).egress_usd == 0


def test_a_read_by_a_node_outside_the_run_is_refused():
    with pytest.raises(InvalidUsageError, match="unknown node 'elsewhere'"):
        compute_bill(_usage(StoreRead(STORE, "elsewhere", 1)), PRICES)
