"""The port a run's rank 0 listens on is taken free on its node at launch: the control plane
suggests one (never derived from the run id), rank 0's agent keeps it or binds another and
names it in its `started` event, and only then are the other ranks sent it. Over the real API
on the real Postgres, with orders read back from the real Redis."""

from __future__ import annotations

import pytest
from runs_testing import API, cancel_created_runs_fixture, dispatched_fixture, online_node_fixture, post_run, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from agents.celery_app import LAUNCH_ROLE


def _create(client, nodes, **fields):
    return post_run(client, run_body(nodes, strategy="ps", ps_node_id=nodes[0].id, **fields))


def _launches(dispatched, node, rid):
    """{rank: spec} of the launch orders for run `rid` waiting on `node`'s queue (taken)."""
    return {args[1]: args[2] for task, args in dispatched.take(node.id) if task == LAUNCH_ROLE and args[0] == rid}


def test_a_new_run_sends_rank_0_alone_asking_its_agent_to_check_the_port(online_node, client, dispatched):
    a, b = online_node(), online_node()
    run = _create(client, [a, b])

    sent = _launches(dispatched, a, run["id"]) | _launches(dispatched, b, run["id"])

    assert list(sent) == [0] and sent[0]["pick_port"] is True
    assert [w["status"] for w in run["workers"]] == ["launched", "planned", "planned"]


def test_the_other_ranks_get_the_port_rank_0_named(online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = _create(client, [a, b])["id"]
    dispatched.take(a.id)

    a.event(rid, rank=0, role="ps", event="started", pid=1, port=41234)

    sent = _launches(dispatched, a, rid) | _launches(dispatched, b, rid)
    assert sorted(sent) == [1, 2]
    assert {spec["master_port"] for spec in sent.values()} == {41234}
    assert not any(spec["pick_port"] for spec in sent.values())
    assert client.get(f"{API}/runs/{rid}").json()["master_port"] == 41234


def test_two_runs_on_one_server_node_are_suggested_different_ports(online_node, client, dispatched):
    a = online_node()
    first = _create(client, [a], share_gpus=True)
    second = _create(client, [a], share_gpus=True)

    assert first["status"] == second["status"] == "launching"
    assert first["master_port"] != second["master_port"]


def test_a_restarted_run_gets_the_port_its_node_reported(online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = _create(client, [a, b], max_restarts=2)["id"]
    a.event(rid, rank=0, role="ps", event="started", pid=1, port=41000)
    a.event(rid, rank=1, role="worker", event="started", pid=2)
    b.event(rid, rank=2, role="worker", event="started", pid=3)
    dispatched.take(a.id), dispatched.take(b.id)

    a.event(rid, rank=0, role="ps", event="exited", signal=9, pid=1)
    relaunched = _launches(dispatched, a, rid) | _launches(dispatched, b, rid)
    assert list(relaunched) == [0] and relaunched[0]["pick_port"] is True
    assert relaunched[0]["master_port"] != 41000  # the killed server's socket may linger

    a.event(rid, rank=0, role="ps", event="started", pid=11, attempt=1, port=42000)

    sent = _launches(dispatched, a, rid) | _launches(dispatched, b, rid)
    assert sorted(sent) == [1, 2]
    assert {(spec["master_port"], spec["attempt"], spec["options"].get("resume")) for spec in sent.values()} == {
        (42000, 1, True)}
