"""The queue for GPUs, driven over the real API (agents' role events, the liveness pass) on the
real Postgres, with orders read back from the real Redis: a run holds its GPUs while active,
a run on busy GPUs waits in (priority, creation) order and starts when they free up."""

from __future__ import annotations

import pytest

from runs_testing import API, cancel_created_runs_fixture, dispatched_fixture, online_node_fixture, post_run, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from agents.celery_app import CANCEL_RUN, LAUNCH_ROLE
from app.lifecycle import check_liveness, end_run
from app.models import RunStatus
from app.queries.runs import get_run


def _create(client, nodes, **fields):
    """A PS run with its server and one worker on the first of `nodes` (one T4 each)."""
    return post_run(client, run_body(nodes, strategy="ps", ps_node_id=nodes[0].id, **fields))


def _run(client, rid):
    return client.get(f"{API}/runs/{rid}").json()


def _orders_of(dispatched, node, rid):
    """The launch and cancel orders for run `rid` waiting on `node`'s queue (taken from it)."""
    return [task for task, args in dispatched.take(node.id) if task in (LAUNCH_ROLE, CANCEL_RUN) and args[0] == rid]


def _finish(node, rid):
    """The run's server (rank 0) exits 0: the run succeeds."""
    node.event(rid, rank=0, role="ps", event="started", pid=10)
    node.event(rid, rank=0, role="ps", event="exited", exit_code=0, pid=10)


def test_a_second_run_on_a_busy_gpu_waits_and_sends_no_order(online_node, client, dispatched):
    a = online_node()
    first = _create(client, [a])
    second = _create(client, [a])

    assert first["status"] == "launching"
    assert second["status"] == "queued" and second["queue_position"] >= 1
    assert any(f"GPU 0 is held by run {first['id']}" in why for why in second["waiting_for"])
    assert _orders_of(dispatched, a, second["id"]) == []


def test_a_queued_run_starts_by_itself_when_the_run_holding_its_gpu_ends(online_node, client, dispatched):
    a = online_node()
    first = _create(client, [a])
    second = _create(client, [a])
    dispatched.take(a.id)

    _finish(a, first["id"])

    run = _run(client, second["id"])
    assert run["status"] == "launching" and run["queue_position"] is None and run["waiting_for"] == []
    # Rank 0 first; the worker follows once it has named its port (tests/app/test_ports.py).
    assert _orders_of(dispatched, a, second["id"]) == [LAUNCH_ROLE]


def test_queued_runs_start_by_priority_then_creation_order(online_node, client, dispatched):
    a = online_node()
    holder = _create(client, [a])
    early = _create(client, [a])
    urgent = _create(client, [a], priority=5)
    late = _create(client, [a])

    queue = client.get(f"{API}/runs", params={"status": "queued", "limit": 500}).json()["data"]
    mine = [r["id"] for r in queue if r["id"] in (early["id"], urgent["id"], late["id"])]
    assert mine == [urgent["id"], early["id"], late["id"]]
    assert _run(client, urgent["id"])["queue_position"] < _run(client, early["id"])["queue_position"]

    _finish(a, holder["id"])

    assert _run(client, urgent["id"])["status"] == "launching"
    assert _run(client, early["id"])["status"] == "queued"
    assert any(f"held by run {urgent['id']}" in why for why in _run(client, early["id"])["waiting_for"])


def test_a_run_on_free_gpus_is_not_held_back_by_a_waiting_run(online_node, client, dispatched):
    a, b = online_node(), online_node()
    _create(client, [a])
    waiting = _create(client, [a])
    elsewhere = _create(client, [b])

    assert waiting["status"] == "queued"
    assert elsewhere["status"] == "launching"


def test_a_later_run_waits_behind_a_queued_run_that_needs_the_same_gpu(online_node, client, dispatched):
    a, b = online_node(), online_node()
    holder = _create(client, [a])
    wide = _create(client, [a, b])  # waits for a's GPU, and claims b's
    narrow = _create(client, [b])

    assert wide["status"] == "queued" and narrow["status"] == "queued"
    assert any(f"run {wide['id']}, ahead in the queue" in why for why in narrow["waiting_for"])
    _finish(a, holder["id"])
    assert _run(client, wide["id"])["status"] == "launching"


def test_cancelling_a_queued_run_ends_it_without_any_order(online_node, client, dispatched):
    a = online_node()
    _create(client, [a])
    queued = _create(client, [a])
    dispatched.take(a.id)

    answer = client.post(f"{API}/runs/{queued['id']}/cancel")

    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    assert [w["status"] for w in answer.json()["workers"]] == ["cancelled", "cancelled"]
    assert _orders_of(dispatched, a, queued["id"]) == []


def test_runs_that_share_gpus_launch_together(online_node, client, dispatched):
    a = online_node()
    first = _create(client, [a], share_gpus=True)
    second = _create(client, [a], share_gpus=True)

    assert first["status"] == "launching" and second["status"] == "launching"
    assert [w["sharers"] for w in _run(client, second["id"])["workers"]] == [1, 2]


def test_a_sharing_run_waits_for_a_run_that_does_not_share(online_node, client, dispatched):
    a = online_node()
    _create(client, [a])
    sharing = _create(client, [a], share_gpus=True)
    assert sharing["status"] == "queued"


def test_a_run_that_does_not_share_waits_for_sharing_runs(online_node, client, dispatched):
    a = online_node()
    _create(client, [a], share_gpus=True)
    alone = _create(client, [a])
    assert alone["status"] == "queued"


def test_the_liveness_pass_starts_a_queued_run_whose_gpus_are_free(online_node, client, dispatched, session, settings):
    a = online_node()
    first = _create(client, [a])
    second = _create(client, [a])
    # The first run ends without the scheduler hearing of it (a crash between commit and start).
    run = get_run(session, run_id=first["id"], lock=True)
    end_run(session, run=run, status=RunStatus.failed, reason="ended behind the scheduler's back")
    session.commit()
    assert _run(client, second["id"])["status"] == "queued"

    orders = check_liveness(session, settings=settings)
    session.commit()

    assert [(o.run_id, o.rank) for o in orders if o.run_id == second["id"]] == [(second["id"], 0)]
    assert _run(client, second["id"])["status"] == "launching"
