"""Prices: seeded from seed 003's Table 1, versioned so edits never change past bills."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.models import Continent, Provider, TrafficClass
from app.queries.prices import EgressKey, InstanceKey, price_in_force

API = "/api/v1"
APRIL_2023 = "2023-04-01T00:00:00Z"


def _egress(client: TestClient, **params: Any) -> list[dict[str, Any]]:
    return client.get(f"{API}/prices/egress", params={"limit": 1000} | params).json()["data"]


def _t4_id(client: TestClient) -> int:
    catalog = client.get(f"{API}/gpu-models", params={"limit": 1000}).json()["data"]
    return next(g["id"] for g in catalog if g["name"] == "T4")


def test_table1_t4_prices_are_seeded_with_the_papers_date(client: TestClient) -> None:
    rows = client.get(f"{API}/prices/instances").json()["data"]
    prices = {r["provider"]: (r["spot_usd_per_h"], r["on_demand_usd_per_h"]) for r in rows if r["seeded"]}
    assert prices == {"gcp": (0.180, 0.572), "aws": (0.395, 0.802), "azure": (0.134, 0.489)}
    assert {r["effective_from"] for r in rows if r["seeded"]} == {APRIL_2023}
    assert all(r["gpu_model"] == "T4" and "Table 1" in r["source"] for r in rows if r["seeded"])


@pytest.mark.parametrize(
    ("provider", "traffic_class", "continent", "usd_per_gb"),
    [
        ("gcp", "inter_zone", None, 0.01),
        ("azure", "inter_zone", None, 0.00),
        ("gcp", "inter_region", "north_america", 0.01),
        ("gcp", "inter_region", "europe", 0.02),
        ("gcp", "inter_region", "asia", 0.05),
        ("azure", "inter_region", "oceania", 0.08),
        ("gcp", "to_oceania", None, 0.15),
        ("aws", "to_oceania", None, 0.02),
        ("gcp", "inter_continent", None, 0.08),
        ("azure", "inter_continent", None, 0.02),
    ],
)
def test_table1_traffic_rows_are_seeded(
    client: TestClient, provider: str, traffic_class: str, continent: str | None, usd_per_gb: float
) -> None:
    rows = [
        r for r in _egress(client, provider=provider, traffic_class=traffic_class)
        if r["continent"] == continent
    ]
    assert [(r["usd_per_gb"], r["effective_from"]) for r in rows] == [(usd_per_gb, APRIL_2023)]
    assert "Table 1" in rows[0]["source"]


def test_intra_zone_and_internet_egress_are_seeded_and_say_they_are_not_from_the_paper(
    client: TestClient,
) -> None:
    internet = {r["provider"]: r for r in _egress(client, traffic_class="internet")}
    assert {p: r["usd_per_gb"] for p, r in internet.items()} == {"gcp": 0.12, "aws": 0.09, "azure": 0.087}
    assert all("not from seed 003" in r["source"] for r in internet.values())
    assert {r["usd_per_gb"] for r in _egress(client, traffic_class="intra_zone")} == {0.0}


def test_revising_a_price_adds_a_version_and_keeps_the_old_one(client: TestClient) -> None:
    gcp = next(r for r in client.get(f"{API}/prices/instances", params={"provider": "gcp"}).json()["data"])
    response = client.patch(f"{API}/prices/instances/{gcp['id']}", json={"spot_usd_per_h": 0.11})
    assert response.status_code == 201
    revised = response.json()
    assert revised["id"] != gcp["id"]
    assert (revised["spot_usd_per_h"], revised["on_demand_usd_per_h"]) == (0.11, 0.572)
    assert client.get(f"{API}/prices/instances/{gcp['id']}").json()["spot_usd_per_h"] == 0.18
    current = client.get(f"{API}/prices/instances", params={"provider": "gcp"}).json()["data"]
    assert [r["id"] for r in current] == [revised["id"]]
    in_2024 = client.get(
        f"{API}/prices/instances", params={"provider": "gcp", "at": "2024-01-01T00:00:00Z"}
    ).json()["data"]
    assert [r["id"] for r in in_2024] == [gcp["id"]]
    history = client.get(
        f"{API}/prices/instances", params={"provider": "gcp", "all_versions": "true"}
    ).json()
    assert history["count"] == 2


def test_revision_may_not_take_effect_in_the_past(client: TestClient) -> None:
    row = _egress(client, provider="aws", traffic_class="inter_zone")[0]
    response = client.patch(
        f"{API}/prices/egress/{row['id']}",
        json={"usd_per_gb": 0.5, "effective_from": "2024-06-01T00:00:00Z"},
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "effective_from"]


def test_only_the_latest_version_may_be_revised(client: TestClient) -> None:
    row = _egress(client, provider="aws", traffic_class="internet")[0]
    client.patch(f"{API}/prices/egress/{row['id']}", json={"usd_per_gb": 0.085})
    response = client.patch(f"{API}/prices/egress/{row['id']}", json={"usd_per_gb": 0.08})
    assert response.status_code == 409
    assert "superseded" in response.json()["detail"]


def test_scheduled_revision_is_in_force_only_from_its_date(client: TestClient, session: Session) -> None:
    row = _egress(client, provider="gcp", traffic_class="inter_continent")[0]
    start = datetime.now(UTC) + timedelta(days=30)
    response = client.patch(
        f"{API}/prices/egress/{row['id']}",
        json={"usd_per_gb": 0.12, "effective_from": start.isoformat()},
    )
    assert response.status_code == 201
    key = EgressKey(Provider.gcp, TrafficClass.inter_continent)
    assert price_in_force(session, key, at=datetime.now(UTC)).usd_per_gb == 0.08
    assert price_in_force(session, key, at=start + timedelta(seconds=1)).usd_per_gb == 0.12


def test_scheduled_version_may_be_withdrawn_but_one_in_force_may_not(client: TestClient) -> None:
    row = _egress(client, provider="azure", traffic_class="to_oceania")[0]
    later = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    scheduled = client.patch(
        f"{API}/prices/egress/{row['id']}", json={"usd_per_gb": 0.1, "effective_from": later}
    ).json()
    assert client.delete(f"{API}/prices/egress/{row['id']}").status_code == 409
    assert client.delete(f"{API}/prices/egress/{scheduled['id']}").status_code == 204


def test_create_price_for_an_existing_series_is_refused(client: TestClient) -> None:
    body = {
        "provider": "gcp", "region": "us-west", "instance_type": "n1-standard-8",
        "gpu_model_id": _t4_id(client), "gpu_count": 1, "on_demand_usd_per_h": 1.0,
    }
    response = client.post(f"{API}/prices/instances", json=body)
    assert response.status_code == 409
    assert "PATCH" in response.json()["detail"]


def test_create_instance_price_starts_a_new_series(client: TestClient) -> None:
    body = {
        "provider": "lambda", "region": "us-east-1", "instance_type": "gpu_1x_a10",
        "gpu_model_id": _t4_id(client), "on_demand_usd_per_h": 0.6,
    }
    response = client.post(f"{API}/prices/instances", json=body)
    assert response.status_code == 201
    assert response.json()["spot_usd_per_h"] is None
    assert response.json()["seeded"] is False


def test_create_instance_price_with_unknown_gpu_model_answers_404(client: TestClient) -> None:
    body = {
        "provider": "aws", "region": "r", "instance_type": "t", "gpu_model_id": 99999,
        "on_demand_usd_per_h": 1.0,
    }
    response = client.post(f"{API}/prices/instances", json=body)
    assert response.status_code == 404
    assert response.json()["detail"].startswith("gpu_model_id:")


def test_create_egress_price_rejects_naive_effective_from(client: TestClient) -> None:
    body = {
        "provider": "lambda", "traffic_class": "internet", "usd_per_gb": 0,
        "effective_from": "2026-01-01T00:00:00",
    }
    response = client.post(f"{API}/prices/egress", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "effective_from"]


def test_create_egress_price_rejects_an_unknown_traffic_class(client: TestClient) -> None:
    body = {"provider": "aws", "traffic_class": "to_mars", "usd_per_gb": 1}
    response = client.post(f"{API}/prices/egress", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "traffic_class"]


def test_unknown_price_answers_404(client: TestClient) -> None:
    for kind in ("instances", "egress"):
        assert client.get(f"{API}/prices/{kind}/88888").status_code == 404
        assert client.patch(f"{API}/prices/{kind}/88888", json={}).status_code == 404
        assert client.delete(f"{API}/prices/{kind}/88888").status_code == 404


# --- price_in_force, the lookup cost accounting uses ---------------------------------------


def test_price_in_force_returns_the_seeded_price_after_april_2023(client: TestClient, session: Session) -> None:
    key = InstanceKey(Provider.azure, "us-west", "Standard_NC8as_T4_v3", _t4_id(client), 1)
    price = price_in_force(session, key, at=datetime(2023, 6, 1, tzinfo=UTC))
    assert (price.spot_usd_per_h, price.on_demand_usd_per_h) == (0.134, 0.489)


def test_price_in_force_is_none_before_the_first_version(client: TestClient, session: Session) -> None:
    key = InstanceKey(Provider.azure, "us-west", "Standard_NC8as_T4_v3", _t4_id(client), 1)
    assert price_in_force(session, key, at=datetime(2023, 3, 31, tzinfo=UTC)) is None


def test_price_in_force_in_the_past_is_unchanged_by_a_later_edit(client: TestClient, session: Session) -> None:
    key = InstanceKey(Provider.aws, "us-west", "g4dn.2xlarge", _t4_id(client), 1)
    past = datetime.now(UTC) - timedelta(hours=1)
    before = price_in_force(session, key, at=past).on_demand_usd_per_h
    current = price_in_force(session, key, at=datetime.now(UTC))
    client.patch(f"{API}/prices/instances/{current.id}", json={"on_demand_usd_per_h": 9.99})
    assert price_in_force(session, key, at=past).on_demand_usd_per_h == before == 0.802
    assert price_in_force(session, key, at=datetime.now(UTC)).on_demand_usd_per_h == 9.99


def test_egress_price_in_force_prefers_the_continent_row(session: Session) -> None:
    at = datetime(2024, 1, 1, tzinfo=UTC)
    asia = EgressKey(Provider.gcp, TrafficClass.inter_region, Continent.asia)
    assert price_in_force(session, asia, at=at).usd_per_gb == 0.05


def test_egress_price_in_force_falls_back_to_the_any_continent_row(session: Session) -> None:
    at = datetime(2024, 1, 1, tzinfo=UTC)
    key = EgressKey(Provider.aws, TrafficClass.inter_zone, Continent.europe)
    price = price_in_force(session, key, at=at)
    assert price.continent is None and price.usd_per_gb == 0.01


def test_price_in_force_refuses_a_naive_instant(session: Session) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        price_in_force(session, EgressKey(Provider.aws, TrafficClass.internet), at=datetime(2024, 1, 1))
