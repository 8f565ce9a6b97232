"""POST /runs/{id}/nodes: workers added to a running PS run join it with a share of the batch;
every request the run cannot take is refused, naming why."""

from __future__ import annotations

from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from agents.celery_app import LAUNCH_ROLE
from app.models import Node, NodeStatus
from app.queries.events import list_events


def _running_ps_run(online_node, client, dispatched, **fields):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id, **fields)).json()["id"]
    for node, rank in ((a, 0), (a, 1), (b, 2)):
        node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="started", pid=10 + rank)
    dispatched.take(a.id), dispatched.take(b.id)
    return rid, a, b


def test_an_added_node_joins_the_running_run_with_a_share_of_the_batch(online_node, client, dispatched, session):
    rid, a, b = _running_ps_run(online_node, client, dispatched)
    c = online_node()

    answer = client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [c.id]})

    assert answer.status_code == 200, answer.text
    run = answer.json()
    assert run["status"] == "running"
    added = run["workers"][3]
    assert (added["rank"], added["role"], added["node_id"], added["status"]) == (3, "worker", c.id, "launched")
    orders = [args for task, args in dispatched.take(c.id) if task == LAUNCH_ROLE]
    assert [o[1] for o in orders] == [3]
    spec = orders[0][2]
    assert spec["join"] is True and spec["world_size"] == 4
    assert len(spec["batch_sizes"]) == 3 and sum(spec["batch_sizes"]) == 64
    assert spec["batch_sizes"][2] == added["batch_size"]
    assert [(e.kind, e.subject) for e in list_events(session, run_id=rid)] == [("node_added", 3)]

    c.event(rid, rank=3, role="worker", event="started", pid=99)
    assert client.get(f"{API}/runs/{rid}").json()["workers"][3]["status"] == "running"


def test_a_node_whose_worker_left_may_join_again(online_node, client, dispatched):
    rid, a, b = _running_ps_run(online_node, client, dispatched)
    # An error of its own: the node does not rejoin by itself (a killed worker would).
    b.event(rid, rank=2, role="worker", event="exited", exit_code=1, pid=12)

    answer = client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [b.id]})

    assert answer.status_code == 200
    assert [w["rank"] for w in answer.json()["workers"] if w["node_id"] == b.id] == [2, 3]


def test_an_all_reduce_run_takes_no_nodes(online_node, client, dispatched):
    a, c = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a], strategy="allreduce")).json()["id"]
    a.event(rid, rank=0, role="worker", event="started", pid=1)

    answer = client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [c.id]})

    assert answer.status_code == 409 and "fixed size" in answer.json()["detail"]


def test_a_finished_run_takes_no_nodes(online_node, client, dispatched):
    rid, a, b = _running_ps_run(online_node, client, dispatched)
    client.post(f"{API}/runs/{rid}/cancel")

    answer = client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [online_node().id]})

    assert answer.status_code == 409 and "is cancelling" in answer.json()["detail"]


def test_a_node_already_in_the_run_is_refused(online_node, client, dispatched):
    rid, a, b = _running_ps_run(online_node, client, dispatched)

    answer = client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [b.id]})

    assert answer.status_code == 409 and f"{b.name} already have a rank in run {rid}" in answer.json()["detail"]


def test_an_offline_node_is_refused(online_node, client, dispatched, session):
    rid, a, b = _running_ps_run(online_node, client, dispatched)
    c = online_node()
    session.get(Node, c.id).status = NodeStatus.offline
    session.commit()

    answer = client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [c.id]})

    assert answer.status_code == 409 and "is offline" in answer.json()["detail"]


def test_an_unknown_node_is_not_found_naming_its_place(online_node, client, dispatched):
    rid, a, b = _running_ps_run(online_node, client, dispatched)

    answer = client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [online_node().id, 2_000_000_000]})

    assert answer.status_code == 404 and answer.json()["detail"].startswith("node_ids.1:")


def test_an_unknown_run_is_not_found(online_node, client):
    assert client.post(f"{API}/runs/2000000000/nodes", json={"node_ids": [online_node().id]}).status_code == 404
