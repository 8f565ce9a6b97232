"""An agent takes its broker from the control plane: on Redis with a user of its own node,
limited to that node's queue (app/broker_access.py), on the real Redis."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from kombu import Connection
from runs_testing import API, JoinedNode, online_node_fixture  # noqa: F401 (fixtures)

from agents.celery_app import node_transport_options
from app.api.deps import get_dispatcher, get_settings
from app.broker_access import keep_node_user, node_user_name
from app.config import Settings
from app.dispatch import Dispatcher, LaunchOrder, node_queue
from app.models import NodeAgent
from tests.redis_dbs import database, private_redis

BROKER_DB = database(9)


@pytest.fixture
def broker_url(redis_url: str) -> str:
    return private_redis(redis_url, 9)


@pytest.fixture
def on_redis(app: FastAPI, settings: Settings, broker_url: str) -> Iterator[Callable[..., Settings]]:
    """Run the app's agent endpoints as a control plane on Redis (with more settings when given);
    the nodes' broker users made meanwhile are deleted afterwards."""
    dispatcher = Dispatcher(broker_url)
    app.dependency_overrides[get_dispatcher] = lambda: dispatcher

    def _use(**overrides: Any) -> Settings:
        changed = settings.model_copy(update={"celery_broker_url": broker_url, **overrides})
        app.dependency_overrides[get_settings] = lambda: changed
        return changed

    _use()
    try:
        yield _use
    finally:
        app.dependency_overrides.pop(get_settings, None)
        app.dependency_overrides.pop(get_dispatcher, None)
        dispatcher.close()
        admin = redis.Redis.from_url(broker_url)
        for name in admin.execute_command("ACL", "USERS"):  # this worker's only (tests/redis_dbs.py)
            if name.decode().startswith("hybridtrain-node-") and name.decode().endswith(f"-db{BROKER_DB}"):
                admin.execute_command("ACL", "DELUSER", name)


def _broker(node: JoinedNode) -> dict[str, Any]:
    answer = node.agent.post(f"{API}/agent/broker")
    assert answer.status_code == 200, answer.text
    return answer.json()


def _send(broker_url: str, order: LaunchOrder) -> None:
    dispatcher = Dispatcher(broker_url)
    try:
        dispatcher.send([order])
    finally:
        dispatcher.close()


def _consume(url: str, node_id: int) -> list[Any]:
    with Connection(url, transport_options=node_transport_options(url, node_id)) as conn:
        queue = conn.SimpleQueue(node_queue(node_id), no_ack=True)
        try:
            return [queue.get(timeout=2).decode()[0]]
        finally:
            queue.close()


def test_an_agent_on_redis_gets_a_user_of_its_own_node_that_reads_its_orders(on_redis, online_node, broker_url):
    node = online_node()
    broker = _broker(node)
    assert broker["node_user"] is True
    assert broker["url"].startswith(f"redis://{node_user_name(node.id, broker_url)}:")
    assert broker["url"].endswith(f"@127.0.0.1:6379/{BROKER_DB}")

    _send(broker_url, LaunchOrder(node_id=node.id, run_id=5, rank=1, spec={"x": 1}))

    assert _consume(broker["url"], node.id) == [[5, 1, {"x": 1}]]


def test_a_nodes_user_can_neither_read_nor_fill_another_nodes_queue(on_redis, online_node, broker_url):
    mine, theirs = online_node(), online_node()
    url = _broker(mine)["url"]
    _send(broker_url, LaunchOrder(node_id=theirs.id, run_id=6, rank=0, spec={"secret": "s"}))
    stolen = redis.Redis.from_url(url)
    their_queue = node_transport_options(url, theirs.id)["global_keyprefix"] + node_queue(theirs.id)

    with pytest.raises(redis.exceptions.NoPermissionError):
        stolen.lrange(their_queue, 0, -1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        stolen.lpush(their_queue, "forged order")
    with pytest.raises(redis.exceptions.NoPermissionError):
        stolen.keys("*")


def test_a_rejoined_node_gets_a_new_password_and_the_old_one_is_refused(on_redis, online_node, client, make_client):
    node = online_node()
    old = _broker(node)["url"]
    join_token = client.post(f"{API}/nodes/{node.id}/join-token").json()["join_token"]
    agent_token = "hta_" + secrets.token_urlsafe(32)
    rejoined = client.post(f"{API}/agent/register", json={
        "join_token": join_token, "agent_token": agent_token, "hardware": {"address": "127.0.0.1", "gpus": []}})
    assert rejoined.status_code == 201, rejoined.text

    new = make_client(agent_token).post(f"{API}/agent/broker").json()["url"]

    assert new != old
    assert redis.Redis.from_url(new).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(old).ping()


def test_a_deleted_nodes_broker_user_is_gone(on_redis, online_node, client, broker_url):
    node = online_node()
    url = _broker(node)["url"]

    assert client.delete(f"{API}/nodes/{node.id}").status_code == 204

    assert redis.Redis.from_url(broker_url).execute_command("ACL", "GETUSER", node_user_name(node.id, broker_url)) is None
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url).ping()


def test_a_heartbeat_of_an_agent_using_its_user_brings_back_a_user_the_broker_forgot(on_redis, online_node, broker_url):
    node = online_node()
    url = _broker(node)["url"]
    redis.Redis.from_url(broker_url).execute_command("ACL", "DELUSER", node_user_name(node.id, broker_url))

    beat = node.agent.post(f"{API}/agent/heartbeat", json={"roles": [], "broker_user": True})

    assert beat.status_code == 200, beat.text
    assert redis.Redis.from_url(url).ping()


def test_a_user_still_there_is_left_as_it_is(on_redis, online_node, session):
    settings = on_redis()
    node = online_node()
    _broker(node)
    token_hash = session.get(NodeAgent, node.id).token_hash

    assert keep_node_user(settings, node_id=node.id, agent_token_hash=token_hash) is False


def test_agents_get_the_broker_at_the_address_the_deployment_gives_them(on_redis, online_node, broker_url):
    on_redis(broker_url_for_agents=f"redis://broker.example.org:6390/{BROKER_DB}")
    node = online_node()

    url = _broker(node)["url"]

    assert url.startswith(f"redis://{node_user_name(node.id, broker_url)}:")
    assert url.endswith(f"@broker.example.org:6390/{BROKER_DB}")


def test_without_node_users_every_agent_gets_the_shared_url(on_redis, online_node, broker_url):
    on_redis(broker_node_users=False)
    node = online_node()

    assert _broker(node) == {"url": broker_url, "node_user": False}


def test_a_loopback_broker_is_refused_to_an_agent_on_another_host_naming_the_setting(app, on_redis, online_node):
    node = online_node()
    remote = TestClient(app, headers={"Authorization": f"Bearer {node.agent_token}"}, client=("10.20.30.40", 50000))

    answer = remote.post(f"{API}/agent/broker")

    assert answer.status_code == 409
    assert "HYBRIDTRAIN_BROKER_URL_FOR_AGENTS" in answer.json()["detail"]
    assert "10.20.30.40" in answer.json()["detail"]


def test_an_embedded_broker_is_handed_out_by_its_absolute_path_and_made(on_redis, online_node, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the control plane's working directory
    on_redis(celery_broker_url="sqla+sqlite:///./var/broker.db")
    node = online_node()

    broker = _broker(node)

    assert broker == {"url": f"sqla+sqlite:///{tmp_path / 'var' / 'broker.db'}", "node_user": False}
    assert (tmp_path / "var" / "broker.db").exists()


def test_a_broker_refusing_the_acl_commands_answers_503_with_what_to_do(on_redis, online_node, broker_url):
    name, password = f"hybridtrain-test-noacl-{secrets.token_hex(4)}", secrets.token_hex(8)
    admin = redis.Redis.from_url(broker_url)
    admin.execute_command("ACL", "SETUSER", name, "on", f">{password}", "~*", "&*", "+@all", "-@admin", "-acl")
    try:
        on_redis(celery_broker_url=broker_url.replace("redis://", f"redis://{name}:{password}@"))
        node = online_node()

        answer = node.agent.post(f"{API}/agent/broker")

        assert answer.status_code == 503
        assert "HYBRIDTRAIN_BROKER_NODE_USERS=false" in answer.json()["detail"]
    finally:
        admin.execute_command("ACL", "DELUSER", name)


def test_only_an_agent_token_gets_a_broker(on_redis, make_client, admin_token):
    assert make_client(admin_token).post(f"{API}/agent/broker").status_code == 401
    assert make_client(None).post(f"{API}/agent/broker").status_code == 401


def test_a_node_user_is_named_after_its_broker_database_beyond_the_first() -> None:
    # ACL users are the whole server's: two control planes on databases 0 and 3 of one Redis
    # both have a node 7.
    assert node_user_name(7, "redis://:pw@h:6379/0") == "hybridtrain-node-7"
    assert node_user_name(7, "redis://h:6379") == "hybridtrain-node-7"
    assert node_user_name(7, "redis://h:6379/3") == "hybridtrain-node-7-db3"
