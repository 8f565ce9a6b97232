"""Clusters: named sets of existing nodes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

API = "/api/v1"
Factory = Callable[..., dict[str, Any]]


def test_create_cluster_groups_existing_nodes(client: TestClient, make_node: Factory) -> None:
    a, b = make_node(), make_node()
    response = client.post(f"{API}/clusters", json={"name": "hybrid-4", "node_ids": [b["id"], a["id"]]})
    assert response.status_code == 201
    assert sorted(response.json()["node_ids"]) == sorted([a["id"], b["id"]])


def test_create_cluster_with_unknown_node_answers_404_naming_it(client: TestClient, make_node: Factory) -> None:
    node = make_node()
    response = client.post(f"{API}/clusters", json={"name": "c", "node_ids": [node["id"], 777777]})
    assert response.status_code == 404
    assert response.json()["detail"] == "node_ids.1: node 777777 not found"


def test_create_cluster_rejects_a_taken_name(client: TestClient) -> None:
    client.post(f"{API}/clusters", json={"name": "dup"})
    assert client.post(f"{API}/clusters", json={"name": "dup"}).status_code == 409


def test_create_cluster_rejects_repeated_node_ids(client: TestClient, make_node: Factory) -> None:
    node = make_node()
    response = client.post(f"{API}/clusters", json={"name": "c", "node_ids": [node["id"], node["id"]]})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "node_ids"]


def test_update_cluster_replaces_its_nodes(client: TestClient, make_node: Factory) -> None:
    a, b = make_node(), make_node()
    cluster = client.post(f"{API}/clusters", json={"name": "c", "node_ids": [a["id"]]}).json()
    response = client.patch(f"{API}/clusters/{cluster['id']}", json={"node_ids": [b["id"]]})
    assert response.json()["node_ids"] == [b["id"]]


def test_deleting_a_node_removes_it_from_its_clusters(client: TestClient, make_node: Factory) -> None:
    a, b = make_node(), make_node()
    cluster = client.post(f"{API}/clusters", json={"name": "c", "node_ids": [a["id"], b["id"]]}).json()
    client.delete(f"{API}/nodes/{a['id']}")
    assert client.get(f"{API}/clusters/{cluster['id']}").json()["node_ids"] == [b["id"]]


def test_delete_cluster_keeps_its_nodes(client: TestClient, make_node: Factory) -> None:
    node = make_node()
    cluster = client.post(f"{API}/clusters", json={"name": "c", "node_ids": [node["id"]]}).json()
    assert client.delete(f"{API}/clusters/{cluster['id']}").status_code == 204
    assert client.get(f"{API}/nodes/{node['id']}").status_code == 200


def test_list_clusters_filters_by_member_node(client: TestClient, make_node: Factory) -> None:
    a, b = make_node(), make_node()
    client.post(f"{API}/clusters", json={"name": "with-a", "node_ids": [a["id"]]})
    client.post(f"{API}/clusters", json={"name": "with-b", "node_ids": [b["id"]]})
    page = client.get(f"{API}/clusters", params={"node_id": a["id"]}).json()
    assert [c["name"] for c in page["data"]] == ["with-a"] and page["count"] == 1


def test_unknown_cluster_answers_404(client: TestClient) -> None:
    assert client.get(f"{API}/clusters/5555").status_code == 404
    assert client.patch(f"{API}/clusters/5555", json={"name": "x"}).status_code == 404
    assert client.delete(f"{API}/clusters/5555").status_code == 404
