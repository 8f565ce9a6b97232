"""Task profiles: ordering them from nodes' agents, the agents' reports and bundle downloads,
and the reads the planner uses."""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from runs_testing import (  # noqa: F401 (fixtures)
    API,
    JoinedNode,
    dispatched_fixture,
    online_node_fixture,
    runs_redis_url_fixture,
)
from sqlalchemy.orm import Session

from app.api.deps import get_dispatcher
from app.dispatch import Order, ProfileOrder
from app.models import TokenScope
from app.queries.profiles import latest_profiles, task_key
from hybridtrain.contract import PROFILE_TASK

RESULT = {
    "params": 1234, "train_samples": 1000, "eval_samples": 200, "batch": 32,
    "samples_per_s": 850.5, "step_s": 0.0376, "metrics": {"accuracy": True, "val_loss": False},
}


class RecordingDispatcher:
    """Keeps the orders instead of publishing them; `fail` makes it act like a broker that is down."""

    def __init__(self) -> None:
        self.sent: list[Order] = []
        self.fail = False

    def send(self, orders: Iterable[Order]) -> None:
        if self.fail:
            raise ConnectionError("broker unreachable")
        self.sent.extend(orders)

    def send_quietly(self, orders: Iterable[Order]) -> None:
        self.sent.extend(orders)


@pytest.fixture
def recorded(app: FastAPI) -> Iterator[RecordingDispatcher]:
    dispatcher = RecordingDispatcher()
    app.dependency_overrides[get_dispatcher] = lambda: dispatcher
    try:
        yield dispatcher
    finally:
        app.dependency_overrides.pop(get_dispatcher, None)


def upload_bundle(client: TestClient, content: bytes = b"def task(): ...\n") -> tuple[str, bytes]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        info = tarfile.TarInfo("mytask.py")
        info.size = len(content)
        archive.addfile(info, io.BytesIO(content))
    data = buffer.getvalue()
    response = client.post(f"{API}/bundles", content=data, headers={"Content-Type": "application/gzip"})
    assert response.status_code in (200, 201), response.text
    return response.json()["sha256"], data


def order(client: TestClient, nodes: list[JoinedNode], **fields: Any) -> Any:
    body = {"task": "hybridtrain.tasks.digits:smallcnn", "task_args": {"lr": 0.05},
            "node_ids": [n.id for n in nodes], "batch_size": 64, "device": "cpu"} | fields
    return client.post(f"{API}/tasks/profiles", json=body)


def ordered(client: TestClient, nodes: list[JoinedNode], **fields: Any) -> list[dict[str, Any]]:
    response = order(client, nodes, **fields)
    assert response.status_code == 202, response.text
    return response.json()


# --- ordering ---------------------------------------------------------------------------------


def test_create_stores_one_pending_profile_per_node(client, online_node, recorded) -> None:
    nodes = [online_node(), online_node()]
    profiles = ordered(client, nodes)
    assert [p["node_id"] for p in profiles] == [n.id for n in nodes]
    assert {p["status"] for p in profiles} == {"pending"}
    assert {p["task_key"] for p in profiles} == {
        task_key("hybridtrain.tasks.digits:smallcnn", {"lr": 0.05}, None)
    }


def test_create_sends_one_profile_order_per_node(client, online_node, recorded) -> None:
    nodes = [online_node(), online_node()]
    profiles = ordered(client, nodes)
    assert recorded.sent == [
        ProfileOrder(node_id=p["node_id"], profile_id=p["id"], spec={
            "task": "hybridtrain.tasks.digits:smallcnn", "task_args": {"lr": 0.05},
            "bundle": None, "batch_size": 64, "device": "cpu",
        })
        for p in profiles
    ]


def test_profile_order_names_the_bundle_and_its_agent_path(client, online_node, recorded) -> None:
    sha256, _ = upload_bundle(client)
    (profile,) = ordered(client, [online_node()], task="mytask:task", bundle_sha256=sha256)
    (sent,) = recorded.sent
    assert sent.spec["bundle"] == {"sha256": sha256, "path": f"/api/v1/agent/profiles/{profile['id']}/bundle"}
    assert profile["task_key"] == task_key("mytask:task", {"lr": 0.05}, sha256)


def test_profile_order_reaches_the_nodes_queue_as_the_profile_task(client, online_node, dispatched) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    assert dispatched.take(node.id) == [
        (PROFILE_TASK, [profile["id"], {
            "task": "hybridtrain.tasks.digits:smallcnn", "task_args": {"lr": 0.05},
            "bundle": None, "batch_size": 64, "device": "cpu",
        }])
    ]


def test_broker_down_fails_the_profiles_with_the_cause(client, online_node, recorded) -> None:
    recorded.fail = True
    (profile,) = ordered(client, [online_node()])
    assert profile["status"] == "failed"
    assert "broker unreachable" in profile["error"]


def test_unknown_node_is_404_naming_its_place_in_node_ids(client, online_node, recorded) -> None:
    response = order(client, [online_node()], node_ids=[online_node().id, 2_000_000_000])
    assert response.status_code == 404
    assert response.json()["detail"].startswith("node_ids.1:")
    assert recorded.sent == []


def test_node_that_is_not_online_is_409(client, make_node, recorded) -> None:
    node = make_node()  # declared, no agent joined: pending
    response = client.post(f"{API}/tasks/profiles", json={"node_ids": [node["id"]]})
    assert response.status_code == 409
    assert "not online" in response.json()["detail"]


def test_unknown_bundle_is_404_naming_bundle_sha256(client, online_node, recorded) -> None:
    response = order(client, [online_node()], bundle_sha256="b" * 64)
    assert response.status_code == 404
    assert response.json()["detail"].startswith("bundle_sha256:")


def test_malformed_task_is_422_naming_task(client, online_node, recorded) -> None:
    response = order(client, [online_node()], task="not a task ref")
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][-1] == "task"


def test_task_args_with_nan_is_422_naming_task_args(client, online_node, recorded) -> None:
    # Python's json (which FastAPI parses with) reads NaN; JSONB cannot store it.
    body = '{"node_ids": [%d], "task_args": {"lr": NaN}}' % online_node().id
    response = client.post(f"{API}/tasks/profiles", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][-1] == "task_args"


def test_a_node_listed_twice_is_422(client, online_node, recorded) -> None:
    node = online_node()
    response = order(client, [node, node])
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][-2:] == ["node_ids", 1]


def test_read_token_may_not_order_profiles(make_client, token_with_scope, online_node, recorded) -> None:
    reader = make_client(token_with_scope(TokenScope.read))
    assert order(reader, [online_node()]).status_code == 403


# --- the agent's side -------------------------------------------------------------------------


def test_agent_report_stores_the_measurement(client, online_node, recorded) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    response = node.agent.post(f"{API}/agent/profiles/{profile['id']}", json={"status": "done", "result": RESULT})
    assert response.status_code == 200, response.text
    stored = client.get(f"{API}/tasks/profiles/{profile['id']}").json()
    assert stored["status"] == "done"
    assert (stored["params"], stored["train_samples"], stored["eval_samples"]) == (1234, 1000, 200)
    assert stored["samples_per_s"] == 850.5
    assert stored["metrics"] == {"accuracy": True, "val_loss": False}
    assert stored["measured_at"] is not None


def test_agent_of_another_node_is_403(client, online_node, recorded) -> None:
    node, other = online_node(), online_node()
    (profile,) = ordered(client, [node])
    response = other.agent.post(f"{API}/agent/profiles/{profile['id']}", json={"status": "done", "result": RESULT})
    assert response.status_code == 403
    assert client.get(f"{API}/tasks/profiles/{profile['id']}").json()["status"] == "pending"


def test_failed_report_is_stored_with_its_error(client, online_node, recorded) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    response = node.agent.post(
        f"{API}/agent/profiles/{profile['id']}",
        json={"status": "failed", "error": "ModuleNotFoundError: No module named 'mytask'"},
    )
    assert response.status_code == 200
    assert response.json()["status"] == "failed"
    assert response.json()["error"] == "ModuleNotFoundError: No module named 'mytask'"


def test_a_long_error_is_stored_as_its_last_4000_characters(client, online_node, recorded) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    error = "x" * 10_000 + "RuntimeError: the cause"
    response = node.agent.post(f"{API}/agent/profiles/{profile['id']}", json={"status": "failed", "error": error})
    assert response.status_code == 200
    assert len(response.json()["error"]) == 4000
    assert response.json()["error"].endswith("RuntimeError: the cause")


def test_a_repeated_report_changes_nothing(client, online_node, recorded) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    url = f"{API}/agent/profiles/{profile['id']}"
    node.agent.post(url, json={"status": "done", "result": RESULT})
    again = node.agent.post(url, json={"status": "failed", "error": "late duplicate"})
    assert again.status_code == 200
    assert again.json()["status"] == "done"


def test_done_report_without_its_result_is_422_naming_result(client, online_node, recorded) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    response = node.agent.post(f"{API}/agent/profiles/{profile['id']}", json={"status": "done"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][-1] == "result"


def test_report_with_a_system_metric_name_is_422_naming_result_metrics(client, online_node, recorded) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    result = RESULT | {"metrics": {"loss": False}}
    response = node.agent.post(f"{API}/agent/profiles/{profile['id']}", json={"status": "done", "result": result})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][-2:] == ["result", "metrics"]


def test_report_on_an_unknown_profile_is_404(online_node) -> None:
    node = online_node()
    response = node.agent.post(f"{API}/agent/profiles/2000000000", json={"status": "failed", "error": "x"})
    assert response.status_code == 404


def test_agent_downloads_the_bundle_of_its_pending_profile(client, online_node, recorded) -> None:
    sha256, data = upload_bundle(client, b"agent download\n")
    node = online_node()
    (profile,) = ordered(client, [node], task="mytask:task", bundle_sha256=sha256)
    response = node.agent.get(f"{API}/agent/profiles/{profile['id']}/bundle")
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["x-bundle-sha256"] == sha256


def test_agent_of_another_node_may_not_download_the_bundle(client, online_node, recorded) -> None:
    sha256, _ = upload_bundle(client, b"not yours\n")
    node, other = online_node(), online_node()
    (profile,) = ordered(client, [node], task="mytask:task", bundle_sha256=sha256)
    assert other.agent.get(f"{API}/agent/profiles/{profile['id']}/bundle").status_code == 403


def test_profile_bundle_is_409_once_the_profile_ended(client, online_node, recorded) -> None:
    sha256, _ = upload_bundle(client, b"ended\n")
    node = online_node()
    (profile,) = ordered(client, [node], task="mytask:task", bundle_sha256=sha256)
    node.agent.post(f"{API}/agent/profiles/{profile['id']}", json={"status": "failed", "error": "x"})
    assert node.agent.get(f"{API}/agent/profiles/{profile['id']}/bundle").status_code == 409


def test_profile_without_a_bundle_has_no_bundle_to_download(client, online_node, recorded) -> None:
    node = online_node()
    (profile,) = ordered(client, [node])
    response = node.agent.get(f"{API}/agent/profiles/{profile['id']}/bundle")
    assert response.status_code == 404
    assert "has no bundle" in response.json()["detail"]


# --- reads ------------------------------------------------------------------------------------


def test_list_filters_by_task_key_and_node(client, online_node, recorded) -> None:
    node, other = online_node(), online_node()
    mine = ordered(client, [node, other], task_args={"lr": 0.01})
    ordered(client, [node], task_args={"lr": 0.02})
    key = mine[0]["task_key"]
    listed = client.get(f"{API}/tasks/profiles", params={"task_key": key, "node_id": node.id}).json()
    assert [p["id"] for p in listed["data"]] == [mine[0]["id"]]
    assert listed["count"] == 1


def test_task_key_ignores_the_order_of_task_args() -> None:
    assert task_key("m:f", {"a": 1, "b": 2}, None) == task_key("m:f", {"b": 2, "a": 1}, None)
    assert task_key("m:f", {"a": 1}, None) != task_key("m:f", {"a": 1}, "c" * 64)
    assert len(task_key("m:f", {}, None)) == len(hashlib.sha256().hexdigest())


def test_latest_profiles_are_the_newest_done_per_node(client, online_node, recorded, session: Session) -> None:
    node, other = online_node(), online_node()
    first, pending_other = ordered(client, [node, other])
    second, failed_other = ordered(client, [node, other])
    for profile, speed in ((first, 100.0), (second, 200.0)):
        node.agent.post(f"{API}/agent/profiles/{profile['id']}",
                        json={"status": "done", "result": RESULT | {"samples_per_s": speed}})
    other.agent.post(f"{API}/agent/profiles/{failed_other['id']}", json={"status": "failed", "error": "x"})
    latest = latest_profiles(session, task_key=first["task_key"], node_ids=[node.id, other.id])
    assert list(latest) == [node.id]
    assert latest[node.id].id == second["id"]
    assert latest[node.id].samples_per_s == 200.0


def test_unknown_profile_is_404(client: TestClient) -> None:
    assert client.get(f"{API}/tasks/profiles/2000000000").status_code == 404
