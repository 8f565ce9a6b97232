"""The traffic-class rules, case by case against seed 003's Table 1 and the decisions around it."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

from app.billing import (
    Continent,
    EgressKey,
    Provider,
    Route,
    Site,
    SiteKind,
    TrafficClass,
    classify,
)

RUN_AT = datetime(2024, 6, 1, tzinfo=UTC)
NA, EU, ASIA, OCE = "north_america", "europe", "asia", "oceania"

# Every traffic row of Table 1: a pair of same-provider sites that must land on it, the class
# and scope (the sender's continent) it must be given, and the row's $/GB for GC, AWS and Azure,
# typed from the paper. Rows without a continent are found through the any-continent fallback.
TABLE1_ROWS = [
    ("inter-zone", ("us-west", "a", NA), ("us-west", "b", NA),
     TrafficClass.inter_zone, Continent.north_america, ("0.01", "0.01", "0.00")),
    ("inter-region US", ("us-west", "a", NA), ("us-east", "a", NA),
     TrafficClass.inter_region, Continent.north_america, ("0.01", "0.01", "0.02")),
    ("inter-region EU", ("eu-west", "a", EU), ("eu-central", "a", EU),
     TrafficClass.inter_region, Continent.europe, ("0.02", "0.01", "0.02")),
    ("inter-region ASIA", ("asia-east", "a", ASIA), ("asia-northeast", "a", ASIA),
     TrafficClass.inter_region, Continent.asia, ("0.05", "0.01", "0.08")),
    ("inter-region OCE", ("au-southeast1", "a", OCE), ("au-southeast2", "a", OCE),
     TrafficClass.inter_region, Continent.oceania, ("0.08", "0.01", "0.08")),
    ("ANY-OCE from US", ("us-west", "a", NA), ("au-southeast1", "a", OCE),
     TrafficClass.to_oceania, Continent.north_america, ("0.15", "0.02", "0.08")),
    ("ANY-OCE from EU", ("eu-west", "a", EU), ("au-southeast1", "a", OCE),
     TrafficClass.to_oceania, Continent.europe, ("0.15", "0.02", "0.08")),
    ("ANY-OCE from ASIA", ("asia-east", "a", ASIA), ("au-southeast1", "a", OCE),
     TrafficClass.to_oceania, Continent.asia, ("0.15", "0.02", "0.08")),
    ("between continents US-EU", ("us-west", "a", NA), ("eu-west", "a", EU),
     TrafficClass.inter_continent, Continent.north_america, ("0.08", "0.02", "0.02")),
    ("between continents EU-ASIA", ("eu-west", "a", EU), ("asia-east", "a", ASIA),
     TrafficClass.inter_continent, Continent.europe, ("0.08", "0.02", "0.02")),
    ("between continents ASIA-US", ("asia-east", "a", ASIA), ("us-west", "a", NA),
     TrafficClass.inter_continent, Continent.asia, ("0.08", "0.02", "0.02")),
]  # fmt: skip


@pytest.mark.parametrize("provider_index, provider", list(enumerate(["gcp", "aws", "azure"])))
@pytest.mark.parametrize(
    "row, src, dst, traffic_class, scope, rates", TABLE1_ROWS, ids=[r[0] for r in TABLE1_ROWS]
)
def test_table1_row_is_classified_and_priced(
    site, table1, provider_index, provider, row, src, dst, traffic_class, scope, rates
):
    route = classify(site(provider, *src), site(provider, *dst))

    assert route == Route(traffic_class, scope, Provider(provider))
    key = EgressKey(route.payer, route.traffic_class, route.scope)
    assert table1.egress_usd_per_gb(key, RUN_AT) == Decimal(rates[provider_index])


def test_traffic_from_oceania_to_another_continent_is_priced_as_any_oce(site):
    route = classify(site("gcp", "au-southeast1", "a", OCE), site("gcp", "us-west", "a", NA))

    assert route == Route(TrafficClass.to_oceania, Continent.oceania, Provider.gcp)


def test_same_zone_is_intra_zone_and_free_at_every_table1_provider(site, table1):
    for provider in ("gcp", "aws", "azure"):
        route = classify(site(provider, "us-west", "a", NA), site(provider, "us-west", "a", NA))

        assert route.traffic_class is TrafficClass.intra_zone
        key = EgressKey(route.payer, route.traffic_class, route.scope)
        assert table1.egress_usd_per_gb(key, RUN_AT) == 0


def test_cloud_to_onprem_is_internet_paid_by_the_cloud(site):
    route = classify(site("gcp", "us-west", "a", NA), site("onprem", "lab", None, EU))

    assert route == Route(TrafficClass.internet, Continent.north_america, Provider.gcp)


def test_onprem_to_cloud_is_internet_paid_by_nobody(site):
    route = classify(site("onprem", "lab", None, EU), site("gcp", "us-west", "a", NA))

    assert route == Route(TrafficClass.internet, Continent.europe, None)


def test_two_providers_in_the_same_region_is_internet_paid_by_the_sender(site):
    route = classify(site("azure", "us-west", "a", NA), site("aws", "us-west", "a", NA))

    assert route == Route(TrafficClass.internet, Continent.north_america, Provider.azure)


def test_two_onprem_sites_talk_over_the_internet_for_free(site):
    route = classify(
        site("onprem", "x", None, EU, name="lab"), site("onprem", "x", None, EU, name="office")
    )

    assert route == Route(TrafficClass.internet, Continent.europe, None)


def test_within_one_onprem_site_is_intra_zone(site):
    lab = site("onprem", None, None, EU, name="lab")

    assert classify(lab, lab) == Route(TrafficClass.intra_zone, Continent.europe, None)


def test_two_sites_of_other_providers_are_never_one_network(site):
    route = classify(
        site("other", "r1", "a", EU, name="hoster-1"), site("other", "r1", "a", EU, name="hoster-2")
    )

    assert route == Route(TrafficClass.internet, Continent.europe, Provider.other)


def test_unknown_zone_in_the_same_region_prices_as_inter_zone(site):
    route = classify(site("gcp", "us-west", None, NA), site("gcp", "us-west", "a", NA, name="b"))

    assert route.traffic_class is TrafficClass.inter_zone


def test_unknown_region_prices_as_inter_region(site):
    route = classify(site("aws", None, None, NA), site("aws", "us-east", "a", NA))

    assert route == Route(TrafficClass.inter_region, Continent.north_america, Provider.aws)


def test_region_and_zone_compare_without_case(site):
    route = classify(site("gcp", "US-West", "A", NA), site("gcp", "us-west", "a", NA))

    assert route.traffic_class is TrafficClass.intra_zone


def test_site_rejects_a_kind_that_contradicts_its_provider():
    with pytest.raises(ValueError, match="kind='cloud'.*provider='onprem'"):
        Site("lab", SiteKind.cloud, Provider.onprem, Continent.europe)


def test_site_accepts_plain_strings():
    lab = Site("lab", "onprem", "onprem", "europe")

    assert (lab.kind, lab.provider, lab.continent) == (
        SiteKind.onprem,
        Provider.onprem,
        Continent.europe,
    )


def test_vocabularies_match_the_database_models():
    from app.models import enums

    for ours, theirs in [
        (SiteKind, enums.SiteKind),
        (Provider, enums.Provider),
        (Continent, enums.Continent),
        (TrafficClass, enums.TrafficClass),
    ]:
        assert [m.value for m in ours] == [m.value for m in theirs]


def test_billing_imports_without_sqlalchemy():
    code = "import sys, app.billing, app.billing.table1; sys.exit('sqlalchemy' in sys.modules)"

    repo = Path(__file__).resolve().parents[3]

    assert subprocess.run([sys.executable, "-c", code], cwd=repo, check=False).returncode == 0
