"""Sites: CRUD, filters, duplicate names, and no deletion while nodes remain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

API = "/api/v1"
Factory = Callable[..., dict[str, Any]]


def test_create_site_returns_it(client: TestClient) -> None:
    body = {"name": "tum-lab", "kind": "onprem", "provider": "onprem", "continent": "europe"}
    response = client.post(f"{API}/sites", json=body)
    assert response.status_code == 201
    assert response.json() | body == response.json()
    assert client.get(f"{API}/sites/{response.json()['id']}").json()["name"] == "tum-lab"


def test_create_site_rejects_duplicate_name(client: TestClient, make_site: Factory) -> None:
    make_site(name="gcp-us")
    response = client.post(
        f"{API}/sites",
        json={"name": "gcp-us", "kind": "cloud", "provider": "gcp", "continent": "north_america"},
    )
    assert response.status_code == 409
    assert "gcp-us" in response.json()["detail"]


def test_create_site_rejects_missing_field_naming_it(client: TestClient) -> None:
    response = client.post(f"{API}/sites", json={"name": "x", "kind": "cloud", "provider": "aws"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "continent"]


def test_create_site_rejects_unknown_provider(client: TestClient) -> None:
    body = {"name": "x", "kind": "cloud", "provider": "oracle", "continent": "asia"}
    response = client.post(f"{API}/sites", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "provider"]


def test_create_site_rejects_cloud_site_with_onprem_provider(client: TestClient) -> None:
    body = {"name": "x", "kind": "cloud", "provider": "onprem", "continent": "asia"}
    response = client.post(f"{API}/sites", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "provider"]


def test_update_site_changes_the_given_fields_only(client: TestClient, make_site: Factory) -> None:
    site = make_site(zone="us-west1-a")
    response = client.patch(f"{API}/sites/{site['id']}", json={"zone": "us-west1-c"})
    assert response.status_code == 200
    assert response.json()["zone"] == "us-west1-c"
    assert response.json()["region"] == site["region"]


def test_update_site_rejects_taking_another_sites_name(client: TestClient, make_site: Factory) -> None:
    make_site(name="first")
    second = make_site(name="second")
    response = client.patch(f"{API}/sites/{second['id']}", json={"name": "first"})
    assert response.status_code == 409


def test_update_site_rejects_null_for_a_required_field(client: TestClient, make_site: Factory) -> None:
    site = make_site()
    response = client.patch(f"{API}/sites/{site['id']}", json={"name": None})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "name"]


def test_unknown_site_answers_404(client: TestClient) -> None:
    assert client.get(f"{API}/sites/424242").status_code == 404
    assert client.patch(f"{API}/sites/424242", json={"zone": "a"}).status_code == 404
    assert client.delete(f"{API}/sites/424242").status_code == 404


def test_delete_site_without_nodes_removes_it(client: TestClient, make_site: Factory) -> None:
    site = make_site()
    assert client.delete(f"{API}/sites/{site['id']}").status_code == 204
    assert client.get(f"{API}/sites/{site['id']}").status_code == 404


def test_delete_site_with_nodes_is_refused_and_keeps_the_nodes(
    client: TestClient, make_site: Factory, make_node: Factory
) -> None:
    site = make_site()
    node = make_node(site_id=site["id"])
    response = client.delete(f"{API}/sites/{site['id']}")
    assert response.status_code == 409
    assert "still has nodes" in response.json()["detail"]
    assert client.get(f"{API}/nodes/{node['id']}").status_code == 200


def test_list_sites_filters_by_kind_provider_and_continent(client: TestClient, make_site: Factory) -> None:
    make_site(name="lab", kind="onprem", provider="onprem", continent="europe", region=None, zone=None)
    make_site(name="aws-eu", provider="aws", continent="europe")
    make_site(name="aws-us", provider="aws", continent="north_america")
    names = lambda **params: [s["name"] for s in client.get(f"{API}/sites", params=params).json()["data"]]  # noqa: E731
    assert names(kind="onprem") == ["lab"]
    assert names(provider="aws") == ["aws-eu", "aws-us"]
    assert names(provider="aws", continent="europe") == ["aws-eu"]


def test_list_sites_paginates_with_total_count(client: TestClient, make_site: Factory) -> None:
    created = [make_site(name=f"s{i}")["id"] for i in range(5)]
    page = client.get(f"{API}/sites", params={"skip": 1, "limit": 2}).json()
    assert page["count"] == 5
    assert [s["id"] for s in page["data"]] == created[1:3]


def test_list_rejects_limit_above_1000(client: TestClient) -> None:
    response = client.get(f"{API}/sites", params={"limit": 1001})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["query", "limit"]
