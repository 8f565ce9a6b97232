"""The client's task-profile calls against the real control plane (FastAPI on Postgres, profile
orders through Redis): one pending profile per node, readable by id and by node."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient
from runs_testing import dispatched_fixture, online_node_fixture, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.cli.client import HybridtrainClient
from hybridtrain.contract import PROFILE_TASK
from tests.app.conftest import ADMIN_TOKEN


@pytest.fixture
def api(make_client: Callable[[str | None], TestClient]) -> Iterator[HybridtrainClient]:
    """The CLI's client, talking to the test app through the test client's in-process transport."""
    with HybridtrainClient("http://testserver", ADMIN_TOKEN, transport=make_client(None)._transport) as client:
        yield client


def test_profiles_are_created_pending_and_read_back(api, online_node, dispatched):
    node = online_node()
    created = api.create_profiles({"task": "hybridtrain.tasks.digits:smallcnn", "task_args": {"lr": 0.05},
                                   "node_ids": [node.id], "batch_size": 16, "device": "cpu"})
    assert [(p["node_id"], p["status"]) for p in created] == [(node.id, "pending")]
    assert api.get_profile(created[0]["id"])["id"] == created[0]["id"]
    assert [p["id"] for p in api.list_profiles(node_id=node.id)["data"]] == [created[0]["id"]]
    assert [task for task, _ in dispatched.take(node.id)] == [PROFILE_TASK]
