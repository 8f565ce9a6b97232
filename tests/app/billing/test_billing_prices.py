"""Price lookups in force at a time, the GB unit and the rounding of money."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from app.billing import (
    BYTES_PER_GB,
    Continent,
    EgressKey,
    Provider,
    StaticPriceTable,
    TrafficClass,
    egress_usd,
    round_usd,
)
from app.billing.table1 import TABLE1_EGRESS, TABLE1_T4, table1_price_table

KEY = EgressKey(Provider.gcp, TrafficClass.inter_zone)
JAN, FEB, MAR = (datetime(2024, m, 1, tzinfo=UTC) for m in (1, 2, 3))


def test_lookup_returns_the_latest_price_effective_at_that_time():
    table = StaticPriceTable(egress=[(KEY, FEB, Decimal("0.02")), (KEY, JAN, Decimal("0.01"))])

    assert table.egress_usd_per_gb(KEY, datetime(2024, 1, 20, tzinfo=UTC)) == Decimal("0.01")
    assert table.egress_usd_per_gb(KEY, FEB) == Decimal("0.02")
    assert table.egress_usd_per_gb(KEY, MAR) == Decimal("0.02")


def test_lookup_before_any_price_took_effect_finds_none():
    table = StaticPriceTable(egress=[(KEY, FEB, Decimal("0.02"))])

    assert table.egress_usd_per_gb(KEY, JAN) is None


def test_lookup_of_an_unpriced_key_finds_none():
    assert StaticPriceTable().egress_usd_per_gb(KEY, JAN) is None


def test_lookup_rejects_a_naive_time():
    with pytest.raises(ValueError, match="naive datetime"):
        StaticPriceTable().egress_usd_per_gb(KEY, datetime(2024, 1, 1))


def test_a_gb_is_two_to_the_thirtieth_bytes():
    assert BYTES_PER_GB == 1_073_741_824
    assert egress_usd(BYTES_PER_GB, Decimal("0.01")) == Decimal("0.01")


def test_egress_of_an_odd_byte_count_is_exact():
    # 3 bytes at $0.08 per 2**30 bytes, to the last digit: 0.24 / 1073741824.
    assert egress_usd(3, Decimal("0.08")) == Decimal("2.2351741790771484375E-10")


def test_money_rounds_half_even_to_a_micro_dollar():
    assert round_usd(Decimal("0.0000005")) == Decimal("0.000000")
    assert round_usd(Decimal("0.0000015")) == Decimal("0.000002")
    assert round_usd(Decimal("1.23456789")) == Decimal("1.234568")


def test_table1_seed_has_each_traffic_row_once_per_provider():
    keys = [row.key for row in TABLE1_EGRESS]

    assert len(keys) == 7 * 3
    assert len(set(keys)) == len(keys)


def test_table1_t4_prices_are_the_papers():
    spot_and_on_demand = {
        provider: (price.spot_usd_per_hour, price.on_demand_usd_per_hour)
        for provider, (_instance_type, price) in TABLE1_T4.items()
    }

    assert spot_and_on_demand == {
        Provider.gcp: (Decimal("0.180"), Decimal("0.572")),
        Provider.aws: (Decimal("0.395"), Decimal("0.802")),
        Provider.azure: (Decimal("0.134"), Decimal("0.489")),
    }


def test_table1_prices_take_effect_in_april_2023():
    table = table1_price_table()
    key = EgressKey(Provider.gcp, TrafficClass.to_oceania)

    assert table.egress_usd_per_gb(key, datetime(2023, 3, 31, tzinfo=UTC)) is None
    assert table.egress_usd_per_gb(key, datetime(2023, 4, 1, tzinfo=UTC)) == Decimal("0.15")


def test_a_continent_specific_egress_price_wins_over_the_any_continent_one():
    any_continent = EgressKey(Provider.aws, TrafficClass.internet)
    from_asia = EgressKey(Provider.aws, TrafficClass.internet, Continent.asia)
    table = StaticPriceTable(
        egress=[(any_continent, JAN, Decimal("0.09")), (from_asia, JAN, Decimal("0.12"))]
    )

    assert table.egress_usd_per_gb(from_asia, FEB) == Decimal("0.12")
    assert table.egress_usd_per_gb(
        EgressKey(Provider.aws, TrafficClass.internet, Continent.europe), FEB
    ) == Decimal("0.09")


def test_an_any_continent_lookup_ignores_continent_specific_prices():
    from_asia = EgressKey(Provider.aws, TrafficClass.internet, Continent.asia)
    table = StaticPriceTable(egress=[(from_asia, JAN, Decimal("0.12"))])

    assert table.egress_usd_per_gb(EgressKey(Provider.aws, TrafficClass.internet), FEB) is None
