"""`hybridtrain clusters list|create|show|delete` against a served control plane, and the
cluster "local" that `hybridtrain local` leaves for `runs create --cluster 1`."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from runs_testing import online_node_fixture  # noqa: F401 (fixture)
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from app.cli import main
from app.cli.local import LOCAL_CLUSTER, ensure_local_node
from app.models import Cluster, Node
from tests.app.serving import cli_server


@pytest.fixture
def server(app: FastAPI, make_client: Callable[[str | None], TestClient]) -> Iterator[list[str]]:
    with cli_server(app, "uvicorn-clusters-cli-test") as argv:
        yield argv


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_clusters_create_by_node_names_then_list_and_show_them(server, make_node, capsys):
    a, b = make_node(), make_node()
    code, out, err = _cli(capsys, "clusters", "create", "--name", "pair", "--nodes", f"{a['name']},{b['id']}",
                          "--json", *server)
    assert code == 0, err
    cluster = json.loads(out)
    assert cluster["node_ids"] == [a["id"], b["id"]]

    listed = _cli(capsys, "clusters", "list", *server)[1]
    assert f"{cluster['id']:>5}  pair" in listed and f"{a['id']},{b['id']}" in listed
    code, shown, _ = _cli(capsys, "clusters", "show", "pair", *server)
    assert code == 0
    assert a["name"] in shown and b["name"] in shown and "1x T4" in shown


def test_clusters_create_online_takes_only_the_online_nodes(server, make_node, online_node, capsys):
    offline, online = make_node(), online_node()
    code, out, err = _cli(capsys, "clusters", "create", "--name", "up", "--online", "--json", *server)
    assert code == 0, err
    node_ids = json.loads(out)["node_ids"]
    assert online.id in node_ids and offline["id"] not in node_ids


def test_clusters_delete_by_name_keeps_the_nodes(server, make_node, client, capsys):
    node = make_node()
    _cli(capsys, "clusters", "create", "--name", "gone", "--nodes", str(node["id"]), *server)
    code, _, err = _cli(capsys, "clusters", "delete", "gone", *server)
    assert code == 0 and "deleted cluster gone" in err
    assert "gone" not in _cli(capsys, "clusters", "list", *server)[1]
    assert client.get(f"/api/v1/nodes/{node['id']}").status_code == 200


def test_clusters_show_of_an_unknown_name_is_a_usage_error_naming_it(server, capsys):
    code, _, err = _cli(capsys, "clusters", "show", "nowhere", *server)
    assert code == 2 and err == "hybridtrain: no cluster named 'nowhere' (see `hybridtrain clusters list`)\n"


def test_clusters_create_with_an_unknown_node_id_fails_with_the_servers_404(server, capsys):
    code, _, err = _cli(capsys, "clusters", "create", "--name", "c", "--nodes", "777777", *server)
    assert code == 1 and err.startswith("hybridtrain: 404: ") and "777777" in err


def _savepoint_factory(connection: Connection) -> Callable[[], Session]:
    return lambda: Session(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)


def test_local_makes_a_cluster_of_this_machine_once(connection: Connection, session: Session):
    factory = _savepoint_factory(connection)
    node_id, cluster_id, join_token = ensure_local_node(factory, continent="europe", need_join_token=True)
    again = ensure_local_node(factory, continent="europe", need_join_token=False)

    assert join_token and again == (node_id, cluster_id, None)
    cluster = session.scalar(select(Cluster).where(Cluster.name == LOCAL_CLUSTER))
    assert cluster is not None and cluster.id == cluster_id
    assert [n.id for n in cluster.nodes] == [node_id]
    assert session.get(Node, node_id) is not None


def test_local_leaves_an_edited_local_cluster_as_it_is(connection: Connection, client: TestClient, make_node):
    other = make_node()
    made = client.post("/api/v1/clusters", json={"name": LOCAL_CLUSTER, "node_ids": [other["id"]]}).json()

    _, cluster_id, _ = ensure_local_node(_savepoint_factory(connection), continent="europe", need_join_token=False)

    assert cluster_id == made["id"]
    assert client.get(f"/api/v1/clusters/{cluster_id}").json()["node_ids"] == [other["id"]]


def test_a_run_plans_on_the_local_cluster_once_the_local_agent_joined(connection: Connection, client: TestClient):
    _, cluster_id, join_token = ensure_local_node(
        _savepoint_factory(connection), continent="europe", need_join_token=True
    )
    body: dict[str, Any] = {"name": "first", "cluster_id": cluster_id, "device": "cpu"}
    before = client.post("/api/v1/runs/plan", json=body)
    assert before.status_code == 409 and "runs need online nodes" in before.json()["detail"]

    hardware = {"hostname": "here", "address": "127.0.0.1", "cpu_cores": 2, "gpus": [],
                "benchmark": {"samples_per_s": 400.0}}
    joined = client.post("/api/v1/agent/register", json={
        "join_token": join_token, "agent_token": "hta_" + secrets.token_urlsafe(32), "hardware": hardware,
    })
    assert joined.status_code == 201, joined.text

    after = client.post("/api/v1/runs/plan", json=body)
    assert after.status_code == 200, after.text
    assert {w["role"] for w in after.json()["workers"]} == {"ps", "worker"}  # ps-bz-gc on one node


def test_runs_create_takes_a_cluster_by_name(server, online_node, capsys):
    node = online_node()
    _cli(capsys, "clusters", "create", "--name", "lab", "--nodes", str(node.id), *server)
    code, out, err = _cli(capsys, "runs", "create", "--name", "r", "--cluster", "lab", "--device", "cpu",
                          "--plan-only", "--no-profile", *server)
    assert code == 0, err
    assert {w["node_id"] for w in json.loads(out)["workers"]} == {node.id}


def test_an_unknown_cluster_name_is_a_usage_error_naming_it(server, capsys):
    code, _, err = _cli(capsys, "runs", "create", "--name", "r", "--cluster", "nowhere", "--plan-only", *server)
    assert code == 2 and err == "hybridtrain: no cluster named 'nowhere' (see `hybridtrain clusters list`)\n"
    code, _, err = _cli(capsys, "plans", "optimize", "--cluster", "nowhere", *server)
    assert code == 2 and "no cluster named 'nowhere'" in err
