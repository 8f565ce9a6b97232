"""Fixtures of the run tests: orders on the real Redis, nodes whose agents have joined.

Import the fixtures into a test module (`from runs_testing import dispatched_fixture, ...`);
they register under their short names (`dispatched`, `online_node`, `runs_redis_url`).
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kombu import Connection

from app.api.deps import get_dispatcher
from tests.redis_dbs import private_redis
from agents.celery_app import node_transport_options
from app.dispatch import Dispatcher, node_queue

API = "/api/v1"



class Orders:
    """Reads back, from the real broker, what the control plane published to node queues."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url

    def take(self, node_id: int) -> list[tuple[str, list[Any]]]:
        """Every order waiting on the node's queue, as (task name, args), removed from it."""
        return [(task, args) for task, args, _ in self.take_calls(node_id)]

    def take_calls(self, node_id: int) -> list[tuple[str, list[Any], dict[str, Any]]]:
        """Every order waiting on the node's queue, as (task name, args, kwargs), removed from it."""
        out = []
        with Connection(self.broker_url, transport_options=node_transport_options(self.broker_url, node_id)) as conn:
            queue = conn.SimpleQueue(node_queue(node_id), no_ack=True)
            try:
                while True:
                    try:
                        # Published before the API answered; a blocking get would wait out kombu's
                        # Redis poll (a whole second) on every empty queue.
                        message = queue.get(block=False)
                    except queue.Empty:
                        break
                    args, kwargs, _embed = message.decode()
                    out.append((message.headers["task"], args, kwargs))
            finally:
                queue.close()
        return out


@pytest.fixture(scope="session", name="runs_redis_url")
def runs_redis_url_fixture(redis_url: str) -> str:
    """A Redis database of the run tests' own."""
    return private_redis(redis_url, 11)


@pytest.fixture(name="dispatched")
def dispatched_fixture(app: FastAPI, runs_redis_url: str) -> Iterator[Orders]:
    """The app publishes to the real Redis; the test reads the orders back."""
    redis_url = runs_redis_url
    dispatcher = Dispatcher(redis_url)
    app.dependency_overrides[get_dispatcher] = lambda: dispatcher
    try:
        yield Orders(redis_url)
    finally:
        app.dependency_overrides.pop(get_dispatcher, None)
        dispatcher.close()


@dataclass
class JoinedNode:
    """A node whose agent has registered, and a client holding that agent's token."""

    id: int
    name: str
    join_token: str
    agent_token: str
    agent: TestClient
    site_id: int

    def event(self, run_id: int, **body: Any) -> Any:
        return self.agent.post(f"{API}/agent/runs/{run_id}/events", json=body)


@pytest.fixture(name="online_node")
def online_node_fixture(
    client: TestClient,
    make_site: Callable[..., dict[str, Any]],
    make_client: Callable[[str | None], TestClient],
) -> Callable[..., JoinedNode]:
    """Create a node (declared GPUs, site) and register an agent for it: the node is online."""

    def _make(
        gpu: str | None = "T4", *, site_id: int | None = None, detected: list[dict[str, Any]] | None = None,
        samples_per_s: float | None = 500.0, address: str = "127.0.0.1", data_cache: dict[str, Any] | None = None,
    ) -> JoinedNode:
        site_id = site_id or make_site()["id"]
        body = {"name": f"node-{uuid.uuid4().hex[:8]}", "site_id": site_id,
                "gpus": [{"model": gpu, "count": 1}] if gpu else []}
        created = client.post(f"{API}/nodes", json=body)
        assert created.status_code == 201, created.text
        node = created.json()
        agent_token = "hta_" + secrets.token_urlsafe(32)
        hardware: dict[str, Any] = {"hostname": node["name"], "address": address, "cpu_cores": 4,
                                    "gpus": detected or []}
        if samples_per_s:
            hardware["benchmark"] = {"samples_per_s": samples_per_s}
        if data_cache is not None:
            hardware["data_cache"] = data_cache
        registered = client.post(
            f"{API}/agent/register",
            json={"join_token": node["join_token"], "agent_token": agent_token, "hardware": hardware},
        )
        assert registered.status_code == 201, registered.text
        return JoinedNode(node["id"], node["name"], node["join_token"], agent_token,
                          make_client(agent_token), site_id)

    return _make


def run_body(nodes: list[JoinedNode], **fields: Any) -> dict[str, Any]:
    """A small run over `nodes`."""
    return {"name": f"run-{uuid.uuid4().hex[:6]}", "node_ids": [n.id for n in nodes],
            "strategy": "ps-bz-gc", "global_batch_size": 64, "max_steps": 20} | fields


# Runs created through `post_run`; `cancel_created_runs` cancels those a test leaves active.
_CREATED: list[int] = []


def post_run(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    """Create a run (201 or the test fails) that is cancelled after the test if still active."""
    answer = client.post(f"{API}/runs", json=body)
    assert answer.status_code == 201, answer.text
    _CREATED.append(answer.json()["id"])
    return answer.json()


@pytest.fixture(autouse=True, name="cancel_created_runs")
def cancel_created_runs_fixture(client: TestClient) -> Iterator[None]:
    """Runs a test leaves active are cancelled, so that no later test's liveness pass starts
    or fails them (autouse where imported)."""
    yield
    while _CREATED:
        client.post(f"{API}/runs/{_CREATED.pop()}/cancel")
