"""Each path through a run's life, driven over the real API (agents' role events and
heartbeats, the liveness pass) on the real Postgres, with orders read back from the real Redis."""

from __future__ import annotations

from datetime import timedelta

from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from sqlalchemy import update

from agents.celery_app import CANCEL_RUN, LAUNCH_ROLE
from app.lifecycle import check_liveness
from app.models import RunWorker
from app.models.base import utcnow
from app.queries.events import list_events
from app.queries.runs import get_run
from hybridtrain.contract import EXIT_TOO_FEW_WORKERS


def _ps_run(online_node, client, dispatched, **fields):
    """A PS run: the server (rank 0) and a worker (rank 1) on node a, a worker (rank 2) on b;
    every rank started, the launch orders taken."""
    a, b = online_node(), online_node()
    run = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id, **fields))
    assert run.status_code == 201, run.text
    rid = run.json()["id"]
    for node, rank in ((a, 0), (a, 1), (b, 2)):
        node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="started", pid=100 + rank)
    dispatched.take(a.id), dispatched.take(b.id)
    return rid, a, b


def _run_orders(dispatched, node):
    """The launch and cancel orders waiting for `node` (link probes between nodes left out)."""
    return [(task, args) for task, args in dispatched.take(node.id) if task in (LAUNCH_ROLE, CANCEL_RUN)]


def _run(client, rid):
    return client.get(f"{API}/runs/{rid}").json()


def _kinds(session, rid):
    session.expire_all()
    return [(e.kind, e.subject) for e in list_events(session, run_id=rid)]


def test_a_new_run_is_launching_until_every_rank_has_started(online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id)).json()["id"]
    assert _run(client, rid)["status"] == "launching"

    a.event(rid, rank=0, role="ps", event="started", pid=1)
    a.event(rid, rank=1, role="worker", event="started", pid=2)
    assert _run(client, rid)["status"] == "launching"
    b.event(rid, rank=2, role="worker", event="started", pid=3)
    assert _run(client, rid)["status"] == "running"


def test_a_failed_worker_degrades_a_ps_run_which_trains_on(online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched)

    answer = b.event(rid, rank=2, role="worker", event="exited", exit_code=1, pid=102,
                     reason="rank 2 (worker) exited with code 1: RuntimeError: boom")

    run = _run(client, rid)
    assert answer.json()["run_status"] == "degraded"
    assert run["status"] == "degraded" and run["reason"] is None and run["finished_at"] is None
    assert [w["status"] for w in run["workers"]] == ["running", "running", "failed"]
    assert _run_orders(dispatched, a) == [] and _run_orders(dispatched, b) == []
    assert ("degraded", 2) in _kinds(session, rid) and ("role_exited", 2) in _kinds(session, rid)


def test_a_ps_run_whose_every_worker_failed_with_an_error_fails_at_once(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)

    a.event(rid, rank=1, role="worker", event="exited", exit_code=1, pid=101, reason="rank 1: TypeError: no_such_arg")
    assert _run(client, rid)["status"] == "degraded"
    b.event(rid, rank=2, role="worker", event="exited", exit_code=1, pid=102, reason="rank 2: TypeError: no_such_arg")

    run = _run(client, rid)
    assert run["status"] == "failed" and run["reason"].startswith("every worker failed: rank 2: TypeError")


def test_a_ps_run_whose_last_worker_was_killed_waits_for_joiners(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)

    a.event(rid, rank=1, role="worker", event="exited", exit_code=1, pid=101, reason="rank 1: RuntimeError")
    b.event(rid, rank=2, role="worker", event="exited", signal=9, pid=102)

    assert _run(client, rid)["status"] == "degraded"


def test_a_worker_killed_by_a_signal_degrades_the_run(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)

    b.event(rid, rank=2, role="worker", event="exited", signal=9, pid=102)

    run = _run(client, rid)
    assert run["status"] == "degraded"
    assert run["workers"][2]["reason"] == "rank 2 (worker) was killed by signal 9"


def _joins(dispatched, node):
    """(rank, spec) of each join launch waiting for `node`."""
    return [(args[1], args[2]) for task, args in _run_orders(dispatched, node) if task == LAUNCH_ROLE]


def test_a_worker_killed_by_a_signal_rejoins_from_its_node_as_a_new_rank(online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched)

    b.event(rid, rank=2, role="worker", event="exited", signal=9, pid=102)

    joins = _joins(dispatched, b)
    assert [rank for rank, _ in joins] == [3] and joins[0][1]["join"] is True
    assert [(w["rank"], w["status"]) for w in _run(client, rid)["workers"]][2:] == [(2, "failed"), (3, "launched")]
    assert ("node_rejoined", 2) in _kinds(session, rid)


def test_a_worker_that_failed_with_an_error_of_its_own_does_not_rejoin(online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched)

    b.event(rid, rank=2, role="worker", event="exited", exit_code=1, pid=102, reason="rank 2: ValueError: bad batch")

    assert _joins(dispatched, b) == []
    assert ("node_rejoined", 2) not in _kinds(session, rid)


def test_a_nodes_rejoins_stop_at_the_runs_max_restarts(online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched, max_restarts=1)
    b.event(rid, rank=2, role="worker", event="exited", signal=9, pid=102)
    assert [rank for rank, _ in _joins(dispatched, b)] == [3]
    b.event(rid, rank=3, role="worker", event="started", pid=103)

    b.event(rid, rank=3, role="worker", event="exited", signal=9, pid=103)

    assert _joins(dispatched, b) == []
    assert [w["status"] for w in _run(client, rid)["workers"]][2:] == ["failed", "failed"]


def test_a_node_back_online_rejoins_the_run_that_lost_its_worker_while_it_was_away(
        online_node, client, dispatched, session, settings):
    rid, a, b = _ps_run(online_node, client, dispatched)
    later = utcnow() + timedelta(seconds=31)
    from app.models import Node

    session.get(Node, a.id).last_heartbeat = later
    check_liveness(session, settings=settings.model_copy(update={"heartbeat_timeout_s": 30}), now=later)
    session.commit()
    assert _run(client, rid)["workers"][2]["status"] == "failed" and _joins(dispatched, b) == []

    beat = b.agent.post(f"{API}/agent/heartbeat", json={"roles": []})

    assert beat.status_code == 200 and beat.json()["status"] == "online"
    assert [rank for rank, _ in _joins(dispatched, b)] == [3]


def test_a_worker_that_leaves_cleanly_is_left_and_the_run_degraded(online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched)

    b.event(rid, rank=2, role="worker", event="exited", exit_code=0, pid=102,
            cancelled=True, reason="rank 2 (worker) stopped: spot notice")

    run = _run(client, rid)
    assert run["status"] == "degraded"
    assert run["workers"][2]["status"] == "left"
    assert ("degraded", 2) in _kinds(session, rid)


def test_the_servers_success_ends_the_run_and_its_workers_end_by_themselves(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)

    a.event(rid, rank=0, role="ps", event="exited", exit_code=0, pid=100)
    run = _run(client, rid)
    assert run["status"] == "succeeded" and run["finished_at"] is not None
    assert [w["status"] for w in run["workers"]] == ["succeeded", "running", "running"]
    assert _run_orders(dispatched, a) == [] and _run_orders(dispatched, b) == []

    b.event(rid, rank=2, role="worker", event="exited", exit_code=0, pid=102)
    assert _run(client, rid)["workers"][2]["status"] == "succeeded"


def test_workers_still_running_after_the_grace_are_cancelled(online_node, client, dispatched, session, settings):
    rid, a, b = _ps_run(online_node, client, dispatched)
    a.event(rid, rank=0, role="ps", event="exited", exit_code=0, pid=100)
    a.event(rid, rank=1, role="worker", event="exited", exit_code=0, pid=101)
    later = utcnow() + timedelta(seconds=settings.finish_grace_s + 1)

    # Within the grace a heartbeat leaves the worker alone.
    early = b.agent.post(f"{API}/agent/heartbeat", json={"roles": [
        {"run_id": rid, "rank": 2, "role": "worker", "pid": 102, "state": "running"}]})
    assert early.json()["stop"] == []
    session.expire_all()
    orders = check_liveness(session, settings=settings.model_copy(update={"heartbeat_timeout_s": 3600}), now=later)
    session.commit()

    assert [(o.node_id, o.run_id) for o in orders] == [(b.id, rid)]
    assert _run(client, rid)["workers"][2]["status"] == "cancelled"


def test_a_restarts_cancel_orders_stop_only_the_roles_of_earlier_attempts(online_node, client, dispatched, session):
    # The agent may run the new attempt's launch before the cancel; the cancel must spare it.
    rid, a, b = _ps_run(online_node, client, dispatched, max_restarts=2)

    a.event(rid, rank=0, role="ps", event="exited", signal=9, pid=100)

    cancels = [(args, kwargs) for node in (a, b) for task, args, kwargs in dispatched.take_calls(node.id)
               if task == CANCEL_RUN and args[0] == rid]
    assert len(cancels) == 2 and all(kwargs == {"before_attempt": 1} for _, kwargs in cancels)


def test_a_heartbeat_with_a_role_of_an_earlier_attempt_stops_only_earlier_attempts(
        online_node, client, dispatched):
    # The answer may reach the agent after the new attempt of that rank has started there.
    rid, a, b = _ps_run(online_node, client, dispatched, max_restarts=2)
    a.event(rid, rank=0, role="ps", event="exited", signal=9, pid=100)

    beat = b.agent.post(f"{API}/agent/heartbeat", json={"roles": [
        {"run_id": rid, "rank": 2, "role": "worker", "attempt": 0, "pid": 102, "state": "running"}]})

    assert beat.json()["stop"] == [{"run_id": rid, "rank": 2, "before_attempt": 1,
                                    "reason": f"run {rid} restarted: attempt 0 is over"}]


def test_the_servers_death_restarts_the_run_from_its_latest_checkpoint(online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched, max_restarts=2)
    first_port = _run(client, rid)["master_port"]

    a.event(rid, rank=0, role="ps", event="exited", signal=9, pid=100)

    run = _run(client, rid)
    assert run["status"] == "restarting" and run["restarts"] == 1 and run["reason"] is None
    # Rank 0 first; the others once it has named its port.
    assert [w["status"] for w in run["workers"]] == ["launched", "planned", "planned"]
    orders_a, orders_b = _run_orders(dispatched, a), _run_orders(dispatched, b)
    # The survivors are stopped before every rank is launched again, resuming.
    assert [task for task, _ in orders_a] == [CANCEL_RUN, LAUNCH_ROLE]
    assert [task for task, _ in orders_b] == [CANCEL_RUN]
    # A new port: the killed server's socket may still hold the old one.
    assert orders_a[1][1][2]["master_port"] == run["master_port"] != first_port
    a.event(rid, rank=0, role="ps", event="started", pid=200, attempt=1, port=40200)
    orders_b = _run_orders(dispatched, b)
    assert [task for task, _ in orders_b] == [LAUNCH_ROLE]
    spec = orders_b[0][1][2]
    assert spec["options"]["resume"] is True and spec["attempt"] == 1 and spec["join"] is False
    assert spec["master_port"] == 40200
    assert spec["checkpoint_url"].endswith(f"/api/v1/runs/{rid}/checkpoint")
    events = [e for e in list_events(session, run_id=rid) if e.kind == "restart"]
    assert [e.detail for e in events] == [
        f"rank 0 (ps) was killed by signal 9 on node {a.name}; restart 1 of 2"]


def test_a_restart_retires_the_metrics_token(online_node, client, dispatched):
    a = online_node()
    b = online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id)).json()["id"]
    first = {args[1]: args[2] for _, args in _run_orders(dispatched, a) + _run_orders(dispatched, b)}
    a.event(rid, rank=0, role="ps", event="started", pid=100)

    a.event(rid, rank=0, role="ps", event="exited", signal=9, pid=100)
    a.event(rid, rank=0, role="ps", event="started", pid=200, attempt=1)
    second = {args[1]: args[2] for task, args in _run_orders(dispatched, a) + _run_orders(dispatched, b) if task == LAUNCH_ROLE}

    old, new = first[0]["report_token"], second[0]["report_token"]
    assert old != new and second[2]["report_token"].startswith("htr_2.")
    metrics = {"records": [{"rank": 0, "step": 1, "t": 1.0, "name": "loss", "value": 1.0}]}
    assert client.post(f"{API}/runs/{rid}/metrics", json=metrics,
                       headers={"Authorization": f"Bearer {new}"}).status_code == 200
    assert client.post(f"{API}/runs/{rid}/metrics", json=metrics,
                       headers={"Authorization": f"Bearer {old}"}).status_code == 401


def test_exits_of_the_old_processes_do_not_touch_the_restarted_run(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)
    a.event(rid, rank=0, role="ps", event="exited", exit_code=1, pid=100)

    # The cancelled survivors of the first attempt report their ends, one after its new start.
    b.event(rid, rank=2, role="worker", event="exited", signal=15, cancelled=True, pid=102)
    a.event(rid, rank=1, role="worker", event="started", pid=201)
    a.event(rid, rank=1, role="worker", event="exited", exit_code=1, pid=101)

    run = _run(client, rid)
    assert run["status"] == "restarting" and run["restarts"] == 1
    # Rank 1 was held for rank 0's port: its new process's start still counts.
    assert [w["status"] for w in run["workers"]] == ["launched", "running", "planned"]


def test_a_restarted_run_runs_again_once_every_rank_has_started(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)
    a.event(rid, rank=0, role="ps", event="exited", exit_code=1, pid=100)

    for node, rank in ((a, 0), (a, 1), (b, 2)):
        node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="started", pid=300 + rank)

    run = _run(client, rid)
    assert run["status"] == "running" and run["restarts"] == 1
    assert [w["pid"] for w in run["workers"]] == [300, 301, 302]


def test_a_restart_leaves_out_the_workers_already_lost_and_the_run_is_degraded(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)
    b.event(rid, rank=2, role="worker", event="exited", exit_code=1, pid=102)
    dispatched.take(b.id)

    a.event(rid, rank=0, role="ps", event="exited", exit_code=1, pid=100)
    a.event(rid, rank=0, role="ps", event="started", pid=400)
    relaunched = sorted(args[1] for task, args in _run_orders(dispatched, a) + _run_orders(dispatched, b) if task == LAUNCH_ROLE)
    a.event(rid, rank=1, role="worker", event="started", pid=401)

    assert relaunched == [0, 1]
    assert _run(client, rid)["status"] == "degraded"


def test_a_restarts_server_waits_for_the_worker_ranks_it_relaunches_only(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)
    b.event(rid, rank=2, role="worker", event="exited", exit_code=1, pid=102)
    dispatched.take(b.id)

    a.event(rid, rank=0, role="ps", event="exited", exit_code=1, pid=100)
    server = [args[2] for task, args in _run_orders(dispatched, a) if task == LAUNCH_ROLE]
    a.event(rid, rank=0, role="ps", event="started", pid=400, attempt=1)
    held = [args[2] for task, args in _run_orders(dispatched, a) if task == LAUNCH_ROLE]

    # Rank 2 is gone: a server waiting for it would hold the resumed run's start for nothing.
    assert [spec["rank"] for spec in server + held] == [0, 1]
    assert all(spec["options"]["expect-ranks"] == [1] for spec in server + held)


def test_a_first_launch_waits_for_every_planned_worker(online_node, client, dispatched):
    a, b = online_node(), online_node()
    client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id))
    specs = [args[2] for task, args in _run_orders(dispatched, a) + _run_orders(dispatched, b) if task == LAUNCH_ROLE]
    assert specs and all("expect-ranks" not in spec["options"] for spec in specs)


def test_a_run_whose_restarts_are_spent_fails_with_the_reason(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched, max_restarts=1)
    a.event(rid, rank=0, role="ps", event="exited", exit_code=1, pid=100)
    for node, rank in ((a, 0), (a, 1), (b, 2)):
        node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="started", pid=500 + rank)

    a.event(rid, rank=0, role="ps", event="exited", exit_code=1, pid=500)

    run = _run(client, rid)
    assert run["status"] == "failed" and run["restarts"] == 1
    assert run["reason"] == f"rank 0 (ps) exited with code 1 on node {a.name}; no restart left (1 of 1 used)"


def test_a_server_that_gave_up_waiting_for_workers_fails_the_run_without_a_restart(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)

    a.event(rid, rank=0, role="ps", event="exited", exit_code=EXIT_TOO_FEW_WORKERS, pid=100,
            reason="rank 0 (ps) exited with code 3: too few workers")

    run = _run(client, rid)
    assert run["status"] == "failed" and run["restarts"] == 0
    assert run["reason"].startswith("the server gave up waiting for workers: rank 0 (ps) exited with code 3")


def test_any_rank_dying_restarts_an_all_reduce_run(online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="allreduce")).json()["id"]
    a.event(rid, rank=0, role="worker", event="started", pid=1)
    b.event(rid, rank=1, role="worker", event="started", pid=2)
    dispatched.take(a.id), dispatched.take(b.id)

    b.event(rid, rank=1, role="worker", event="exited", signal=9, pid=2)

    assert _run(client, rid)["status"] == "restarting"
    assert [t for t, _ in _run_orders(dispatched, a)] == [CANCEL_RUN, LAUNCH_ROLE]


def test_a_silent_server_node_restarts_the_run_only_where_it_can_run(online_node, client, dispatched, session, settings):
    rid, a, b = _ps_run(online_node, client, dispatched)
    later = utcnow() + timedelta(seconds=31)
    from app.models import Node

    session.get(Node, b.id).last_heartbeat = later

    check_liveness(session, settings=settings.model_copy(update={"heartbeat_timeout_s": 30}), now=later)
    session.commit()

    run = _run(client, rid)
    # The server's node is gone: a restart there is impossible, so the run fails saying why.
    assert run["status"] == "failed"
    assert f"cannot restart: rank(s) 0 need node(s) {a.name}, offline" in run["reason"]


def test_a_launch_order_nobody_answered_is_sent_again(online_node, client, dispatched, session, settings):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id)).json()["id"]
    a.event(rid, rank=0, role="ps", event="started", pid=1)
    a.event(rid, rank=1, role="worker", event="started", pid=2)
    dispatched.take(a.id), dispatched.take(b.id)
    later = utcnow() + timedelta(seconds=settings.launch_resend_s + 1)
    quiet = {"heartbeat_timeout_s": 3600, "launch_timeout_s": 3600}

    orders = check_liveness(session, settings=settings.model_copy(update=quiet), now=later)
    session.commit()

    assert [(o.node_id, o.rank) for o in orders] == [(b.id, 2)]
    assert orders[0].spec["report_token"] == orders[0].spec["report_token"].strip() and orders[0].spec["join"] is False
    # Sent again once, not on every pass.
    assert check_liveness(session, settings=settings.model_copy(update=quiet), now=later) == []


def _exited(node, rid, rank, **fields):
    """`node`'s agent reports that it stopped `rank` of run `rid` on its cancel."""
    return node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="exited", signal=None,
                      exit_code=143, cancelled=True, pid=100 + rank, reason=f"rank {rank} stopped", **fields)


def test_a_heartbeat_with_a_role_of_an_ended_run_gets_it_stopped_and_a_cancel_order(online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)
    client.post(f"{API}/runs/{rid}/cancel", json={"reason": "enough"})
    for rank in (0, 1):
        _exited(a, rid, rank)
    _exited(b, rid, 2)
    assert _run(client, rid)["status"] == "cancelled"
    dispatched.take(a.id), dispatched.take(b.id)

    beat = b.agent.post(f"{API}/agent/heartbeat", json={"roles": [
        {"run_id": rid, "rank": 2, "role": "worker", "pid": 102, "state": "running"}]})

    assert beat.json()["stop"] == [{"run_id": rid, "rank": 2, "reason": "enough", "before_attempt": None}]
    assert _run_orders(dispatched, b) == [(CANCEL_RUN, [rid, "enough"])]


def test_a_heartbeat_with_a_role_of_a_cancelling_run_stops_it_without_a_second_cancel_order(
        online_node, client, dispatched):
    rid, a, b = _ps_run(online_node, client, dispatched)
    client.post(f"{API}/runs/{rid}/cancel", json={"reason": "enough"})
    dispatched.take(a.id), dispatched.take(b.id)

    beat = b.agent.post(f"{API}/agent/heartbeat", json={"roles": [
        {"run_id": rid, "rank": 2, "role": "worker", "pid": 102, "state": "running"}]})

    # The first cancel order is being carried out: the stop list is enough.
    assert beat.json()["stop"] == [{"run_id": rid, "rank": 2, "reason": "enough", "before_attempt": None}]
    assert _run_orders(dispatched, b) == []


def test_a_cancelled_run_reads_cancelling_until_every_agent_reports_its_ranks_gone(
        online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched)

    first = client.post(f"{API}/runs/{rid}/cancel", json={"reason": "enough"})
    second = client.post(f"{API}/runs/{rid}/cancel")
    assert first.status_code == 200 and first.json()["status"] == "cancelling"
    assert first.json()["reason"] == "enough" and first.json()["finished_at"] is None
    assert second.status_code == 409 and "already being cancelled" in second.json()["detail"]
    assert _run_orders(dispatched, a) == [(CANCEL_RUN, [rid, "enough"])]
    assert _run_orders(dispatched, b) == [(CANCEL_RUN, [rid, "enough"])]

    _exited(a, rid, 0)
    _exited(a, rid, 1)
    assert _run(client, rid)["status"] == "cancelling"
    answer = _exited(b, rid, 2)

    run = _run(client, rid)
    assert answer.json()["run_status"] == "cancelled"
    assert run["status"] == "cancelled" and run["reason"] == "enough" and run["finished_at"] is not None
    assert [w["status"] for w in run["workers"]] == ["cancelled"] * 3
    third = client.post(f"{API}/runs/{rid}/cancel")
    assert third.status_code == 409 and "already ended" in third.json()["detail"]


def test_a_rank_that_starts_after_the_cancel_is_told_to_stop_and_its_exit_ends_the_run(
        online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id)).json()["id"]
    # Rank 0's order is out; the others are held until it names its port.
    client.post(f"{API}/runs/{rid}/cancel", json={"reason": "changed my mind"})
    assert [w["status"] for w in _run(client, rid)["workers"]] == ["launched", "cancelled", "cancelled"]

    started = a.event(rid, rank=0, role="ps", event="started", pid=100)
    assert started.json()["action"] == "stop" and started.json()["reason"] == "changed my mind"
    assert _run(client, rid)["status"] == "cancelling"
    _exited(a, rid, 0)
    assert _run(client, rid)["status"] == "cancelled"


def test_a_rank_lost_with_its_agent_counts_as_gone_for_a_cancelling_run(online_node, client, dispatched, session):
    rid, a, b = _ps_run(online_node, client, dispatched)
    client.post(f"{API}/runs/{rid}/cancel")
    _exited(a, rid, 0)
    _exited(a, rid, 1)
    # Started long enough ago that a heartbeat without it is news, not a race with its start.
    session.execute(update(RunWorker).where(RunWorker.run_id == rid)
                    .values(started_at=utcnow() - timedelta(minutes=5)))
    session.commit()

    # b's agent restarted: its heartbeat no longer lists rank 2 (the guard took it down).
    beat = b.agent.post(f"{API}/agent/heartbeat", json={"roles": []})
    assert beat.status_code == 200
    run = _run(client, rid)
    assert run["status"] == "cancelled" and run["workers"][2]["status"] == "cancelled"


def test_a_cancel_that_no_agent_answers_ends_after_the_timeout_and_drains_the_node(
        online_node, client, dispatched, session, settings):
    rid, a, b = _ps_run(online_node, client, dispatched)
    client.post(f"{API}/runs/{rid}/cancel")
    _exited(a, rid, 0)
    _exited(a, rid, 1)
    quiet = {"heartbeat_timeout_s": 3600.0, "launch_resend_s": 3600.0, "launch_timeout_s": 3600.0}

    check_liveness(session, settings=settings.model_copy(update=quiet),
                   now=utcnow() + timedelta(seconds=settings.cancel_timeout_s - 5))
    session.commit()
    assert _run(client, rid)["status"] == "cancelling"
    check_liveness(session, settings=settings.model_copy(update=quiet),
                   now=utcnow() + timedelta(seconds=settings.cancel_timeout_s + 1))
    session.commit()

    run = _run(client, rid)
    assert run["status"] == "cancelled" and run["workers"][2]["status"] == "cancelled"
    assert client.get(f"{API}/nodes/{b.id}").json()["status"] == "draining"
    assert client.get(f"{API}/nodes/{a.id}").json()["status"] == "online"
    events = [e for e in list_events(session, run_id=rid) if e.kind == "cancel_timeout"]
    assert [(e.subject, e.node_id) for e in events] == [(2, b.id)]
    assert f"did not report rank 2 (worker) gone within {settings.cancel_timeout_s:.0f} s" in events[0].detail


def test_a_worker_that_never_joins_is_lost_although_its_order_was_resent(online_node, client, dispatched, session, settings):
    rid, a, b = _ps_run(online_node, client, dispatched)
    c = online_node()
    client.post(f"{API}/runs/{rid}/nodes", json={"node_ids": [c.id]})
    quiet = settings.model_copy(update={"heartbeat_timeout_s": 3600, "launch_timeout_s": 100, "launch_resend_s": 45})
    start = utcnow()

    resent = check_liveness(session, settings=quiet, now=start + timedelta(seconds=50))
    session.commit()
    lost = check_liveness(session, settings=quiet, now=start + timedelta(seconds=101))
    session.commit()

    assert [(o.node_id, o.rank, o.spec["join"]) for o in resent] == [(c.id, 3, True)]
    assert lost == []
    run = _run(client, rid)
    assert run["status"] == "degraded"
    assert run["workers"][3]["reason"] == f"rank 3 (worker) did not join within 100 s (on {c.name})"


def test_a_server_failing_while_it_starts_fails_the_run_without_spending_restarts(online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id)).json()["id"]

    a.event(rid, rank=0, role="ps", event="exited", exit_code=1, pid=7,
            reason="rank 0 (ps) exited with code 1: TypeError: task() got an unexpected keyword argument 'x'")

    run = _run(client, rid)
    assert run["status"] == "failed" and run["restarts"] == 0
    assert run["reason"] == (f"rank 0 (ps) exited with code 1: TypeError: task() got an unexpected keyword "
                             f"argument 'x' on node {a.name}; it failed while starting, so it was not restarted")


def test_a_server_killed_while_it_starts_is_restarted(online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id)).json()["id"]

    a.event(rid, rank=0, role="ps", event="exited", signal=9, pid=7)

    assert _run(client, rid)["status"] == "restarting"
