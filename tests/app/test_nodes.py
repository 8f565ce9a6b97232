"""Nodes: declared GPUs, a one-time join token, unique names per site, filters."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.models import Node
from app.queries.nodes import node_by_join_token

API = "/api/v1"
Factory = Callable[..., dict[str, Any]]


def test_create_node_returns_it_with_declared_gpus_and_pending_status(
    client: TestClient, make_site: Factory
) -> None:
    site = make_site(kind="onprem", provider="onprem", region=None, zone=None, continent="europe")
    body = {
        "site_id": site["id"],
        "name": "rig-1",
        "address": "10.0.0.5",
        "gpus": [{"model": "RTX 3090 Ti", "count": 1}, {"model": "RTX 3090", "count": 1}],
        "labels": {"room": "b12"},
        "amortised_usd_per_h": 0.35,
    }
    response = client.post(f"{API}/nodes", json=body)
    assert response.status_code == 201
    node = response.json()
    assert node["status"] == "pending"
    assert node["gpus"] == [{"model": "RTX 3090 Ti", "count": 1}, {"model": "RTX 3090", "count": 1}]
    assert node["labels"] == {"room": "b12"}
    assert node["amortised_usd_per_h"] == 0.35
    assert node["spot"] is False
    assert node["last_heartbeat"] is None
    assert node["detected_hardware"] is None and node["measured_samples_per_s"] is None


def test_create_node_returns_a_join_token_stored_only_as_its_hash(
    client: TestClient, make_node: Factory, session: Session
) -> None:
    node = make_node()
    token = node["join_token"]
    stored = session.get(Node, node["id"])
    assert stored is not None
    assert stored.join_token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert node_by_join_token(session, join_token=token).id == node["id"]
    assert "join_token" not in client.get(f"{API}/nodes/{node['id']}").json()


def test_rotating_the_join_token_invalidates_the_old_one(
    client: TestClient, make_node: Factory, session: Session
) -> None:
    node = make_node()
    response = client.post(f"{API}/nodes/{node['id']}/join-token")
    assert response.status_code == 201
    assert node_by_join_token(session, join_token=node["join_token"]) is None
    assert node_by_join_token(session, join_token=response.json()["join_token"]).id == node["id"]


def test_create_node_rejects_duplicate_name_in_the_same_site(
    client: TestClient, make_site: Factory, make_node: Factory
) -> None:
    site = make_site()
    make_node(site_id=site["id"], name="worker-1")
    response = client.post(f"{API}/nodes", json={"site_id": site["id"], "name": "worker-1"})
    assert response.status_code == 409
    assert "worker-1" in response.json()["detail"]


def test_same_node_name_is_allowed_in_another_site(make_site: Factory, make_node: Factory) -> None:
    make_node(site_id=make_site()["id"], name="worker-1")
    assert make_node(site_id=make_site()["id"], name="worker-1")["name"] == "worker-1"


def test_create_node_in_unknown_site_answers_404_naming_site_id(client: TestClient) -> None:
    response = client.post(f"{API}/nodes", json={"site_id": 987654, "name": "n"})
    assert response.status_code == 404
    assert response.json()["detail"] == "site_id: site 987654 not found"


def test_create_node_with_unknown_gpu_model_answers_404_naming_it(
    client: TestClient, make_site: Factory
) -> None:
    body = {"site_id": make_site()["id"], "name": "n", "gpus": [{"model": "RTX 9090", "count": 2}]}
    response = client.post(f"{API}/nodes", json=body)
    assert response.status_code == 404
    assert response.json()["detail"] == "gpus.0.model: GPU model 'RTX 9090' not found"


def test_create_node_rejects_the_same_gpu_model_twice(client: TestClient, make_site: Factory) -> None:
    gpus = [{"model": "T4", "count": 1}, {"model": "T4", "count": 1}]
    response = client.post(f"{API}/nodes", json={"site_id": make_site()["id"], "name": "n", "gpus": gpus})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "gpus"]


def test_create_node_rejects_zero_gpus_of_a_model(client: TestClient, make_site: Factory) -> None:
    gpus = [{"model": "T4", "count": 0}]
    response = client.post(f"{API}/nodes", json={"site_id": make_site()["id"], "name": "n", "gpus": gpus})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "gpus", 0, "count"]


def test_create_node_rejects_negative_amortised_cost(client: TestClient, make_site: Factory) -> None:
    body = {"site_id": make_site()["id"], "name": "n", "amortised_usd_per_h": -1}
    response = client.post(f"{API}/nodes", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "amortised_usd_per_h"]


def test_update_node_replaces_declared_gpus_and_sets_status(client: TestClient, make_node: Factory) -> None:
    node = make_node()
    response = client.patch(
        f"{API}/nodes/{node['id']}",
        json={"gpus": [{"model": "V100 SXM2", "count": 8}], "status": "draining"},
    )
    assert response.status_code == 200
    assert response.json()["gpus"] == [{"model": "V100 SXM2", "count": 8}]
    assert response.json()["status"] == "draining"


def test_update_node_rejects_moving_onto_a_taken_name(
    client: TestClient, make_site: Factory, make_node: Factory
) -> None:
    site = make_site()
    make_node(site_id=site["id"], name="a")
    other = make_node(name="a")
    response = client.patch(f"{API}/nodes/{other['id']}", json={"site_id": site["id"]})
    assert response.status_code == 409


def test_update_node_into_unknown_site_answers_404(client: TestClient, make_node: Factory) -> None:
    node = make_node()
    assert client.patch(f"{API}/nodes/{node['id']}", json={"site_id": 999999}).status_code == 404


def test_delete_node_removes_it(client: TestClient, make_node: Factory) -> None:
    node = make_node()
    assert client.delete(f"{API}/nodes/{node['id']}").status_code == 204
    assert client.get(f"{API}/nodes/{node['id']}").status_code == 404


def test_unknown_node_answers_404(client: TestClient) -> None:
    assert client.get(f"{API}/nodes/31337").status_code == 404
    assert client.patch(f"{API}/nodes/31337", json={"spot": True}).status_code == 404
    assert client.delete(f"{API}/nodes/31337").status_code == 404
    assert client.post(f"{API}/nodes/31337/join-token").status_code == 404


def test_list_nodes_filters_by_site_status_spot_provider_and_kind(
    client: TestClient, make_site: Factory, make_node: Factory
) -> None:
    lab = make_site(name="lab", kind="onprem", provider="onprem", continent="europe")
    aws = make_site(name="aws", provider="aws")
    a = make_node(site_id=lab["id"], name="a")
    b = make_node(site_id=aws["id"], name="b", spot=True)
    c = make_node(site_id=aws["id"], name="c")
    client.patch(f"{API}/nodes/{c['id']}", json={"status": "offline"})

    def ids(**params: Any) -> list[int]:
        return [n["id"] for n in client.get(f"{API}/nodes", params=params).json()["data"]]

    assert ids(site_id=aws["id"]) == [b["id"], c["id"]]
    assert ids(status="offline") == [c["id"]]
    assert ids(spot="true") == [b["id"]]
    assert ids(provider="aws", spot="false") == [c["id"]]
    assert ids(kind="onprem") == [a["id"]]


def test_list_nodes_paginates_with_total_count(client: TestClient, make_site: Factory, make_node: Factory) -> None:
    site = make_site()
    created = [make_node(site_id=site["id"], name=f"n{i}")["id"] for i in range(7)]
    page = client.get(f"{API}/nodes", params={"site_id": site["id"], "skip": 5, "limit": 5}).json()
    assert page["count"] == 7
    assert [n["id"] for n in page["data"]] == created[5:]


def test_list_nodes_shows_each_node_as_its_own_page_does(
    client: TestClient, make_site: Factory, make_node: Factory, session: Session
) -> None:
    site, other = make_site(), make_site()
    a = make_node(site_id=site["id"], gpus=[{"model": "RTX 3090", "count": 8}, {"model": "T4", "count": 2}],
                  labels={"rack": "r1"}, address="10.0.0.1", instance_type="a2-highgpu-8g")
    # Between the listed nodes, one the filter leaves out: its GPUs must not join the page.
    make_node(site_id=other["id"], gpus=[{"model": "V100 SXM2", "count": 4}])
    b = make_node(site_id=site["id"], gpus=[], spot=True)
    node = session.get(Node, b["id"])
    assert node is not None
    node.detected_hardware = {"gpus": [{"model": "T4", "count": 1}], "mismatch": None}
    node.measured_samples_per_s = 812.5
    session.flush()

    listed = client.get(f"{API}/nodes", params={"site_id": site["id"]}).json()
    assert listed["count"] == 2
    assert listed["data"] == [client.get(f"{API}/nodes/{n['id']}").json() for n in (a, b)]


def test_list_nodes_past_the_last_page_is_empty_with_the_total_count(
    client: TestClient, make_site: Factory, make_node: Factory
) -> None:
    site = make_site()
    for i in range(3):
        make_node(site_id=site["id"], name=f"n{i}")
    page = client.get(f"{API}/nodes", params={"site_id": site["id"], "skip": 10}).json()
    assert page == {"data": [], "count": 3}


def test_list_nodes_rejects_unknown_status_naming_the_parameter(client: TestClient) -> None:
    response = client.get(f"{API}/nodes", params={"status": "sleeping"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["query", "status"]


def test_list_nodes_never_shows_join_tokens_or_their_hashes(client: TestClient, make_node: Factory) -> None:
    node = make_node()
    listed = client.get(f"{API}/nodes", params={"site_id": node["site_id"]}).json()["data"]
    assert listed[0].keys() == client.get(f"{API}/nodes/{node['id']}").json().keys()
    assert not any("join_token" in key for key in listed[0])
