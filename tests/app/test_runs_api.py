"""Runs over REST on the real Postgres, with orders published to the real Redis: agents
joining, planning, idempotent launch, the lifecycle driven by role events, cancel, heartbeats
and the liveness check."""

from __future__ import annotations

from datetime import timedelta

import pytest

from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)
from sqlalchemy import select

from agents.celery_app import CANCEL_RUN, LAUNCH_ROLE
from app.models import Node, NodeStatus
from app.models.base import utcnow
from app.lifecycle import check_liveness
from app.queries.runs import get_run
from hybridtrain import strategy_defaults
from hybridtrain.strategy_defaults import default


def _create(client, body, key=None):
    headers = {"Idempotency-Key": key} if key else {}
    response = client.post(f"{API}/runs", json=body, headers=headers)
    assert response.status_code in (200, 201), response.text
    return response


# -- agents joining ------------------------------------------------------------------------


def test_agent_registration_brings_the_node_online_and_shows_a_hardware_mismatch(online_node, client):
    node = online_node("RTX 3090", detected=[], samples_per_s=812.5)

    shown = client.get(f"{API}/nodes/{node.id}").json()
    assert shown["status"] == "online" and shown["last_heartbeat"] is not None
    assert shown["measured_samples_per_s"] == 812.5
    assert shown["gpus"] == [{"model": "RTX 3090", "count": 1}]
    assert shown["detected_hardware"]["mismatch"] == (
        "declared 1x RTX 3090 but the agent detected no GPU; runs are planned with the declared "
        "GPUs unless allocation 'measured' is asked for"
    )


def test_matching_hardware_shows_no_warning(online_node, client):
    node = online_node("T4", detected=[{"model": "T4", "count": 1, "memory_gb": 15.0}])
    assert client.get(f"{API}/nodes/{node.id}").json()["detected_hardware"]["mismatch"] is None


def test_registration_is_idempotent_for_the_same_agent_and_refused_for_another(online_node, client):
    node = online_node()
    hardware = {"hostname": "h", "gpus": []}

    again = client.post(f"{API}/agent/register", json={
        "join_token": node.join_token, "agent_token": node.agent_token, "hardware": hardware})
    other = client.post(f"{API}/agent/register", json={
        "join_token": node.join_token, "agent_token": "hta_" + "x" * 40, "hardware": hardware})
    unknown = client.post(f"{API}/agent/register", json={
        "join_token": "htj_" + "y" * 40, "agent_token": "hta_" + "z" * 40, "hardware": hardware})

    assert again.status_code == 200 and again.json()["node_id"] == node.id
    assert again.json()["queue"] == f"node.{node.id}"
    assert other.status_code == 409 and "already used by another agent" in other.json()["detail"]
    assert unknown.status_code == 401


def test_a_rotated_join_token_moves_the_node_to_a_new_agent(online_node, client, make_client):
    node = online_node()
    new_join = client.post(f"{API}/nodes/{node.id}/join-token").json()["join_token"]

    moved = client.post(f"{API}/agent/register", json={
        "join_token": new_join, "agent_token": "hta_" + "n" * 40, "hardware": {"gpus": []}})

    assert moved.status_code == 201
    assert node.agent.post(f"{API}/agent/heartbeat", json={"roles": []}).status_code == 401
    assert make_client("hta_" + "n" * 40).post(f"{API}/agent/heartbeat", json={"roles": []}).status_code == 200


# -- planning and launching ----------------------------------------------------------------


def test_plan_preview_places_the_server_and_splits_the_batch_by_catalog_flops(online_node, client, make_site):
    onprem = make_site(kind="onprem", provider="onprem", region=None, zone=None)["id"]
    cloud = make_site()["id"]
    a = online_node("RTX 3090 Ti", site_id=onprem)
    b = online_node("RTX 3090", site_id=onprem)
    c = online_node("V100 PCIe", site_id=cloud)

    plan = client.post(f"{API}/runs/plan", json=run_body([a, b, c], global_batch_size=256)).json()

    assert plan["allocation"] == "flops" and plan["world_size"] == 4
    assert plan["workers"][0]["role"] == "ps" and plan["ps_node_id"] in (a.id, b.id)
    workers = plan["workers"][1:]
    assert [w["speed"] for w in workers] == [40.0, 35.6, 14.0]
    assert sum(w["batch_size"] for w in workers) == 256
    # 253 samples left after one each, split 40 : 35.6 : 14 by largest remainder.
    assert [w["batch_size"] for w in workers] == [114, 101, 41]


def test_plan_refuses_offline_nodes_and_unknown_ones(online_node, client, session):
    a = online_node()
    node = session.get(Node, a.id)
    node.status = NodeStatus.offline
    session.commit()

    offline = client.post(f"{API}/runs/plan", json=run_body([a]))
    unknown = client.post(f"{API}/runs/plan", json={**run_body([a]), "node_ids": [a.id, 2_000_000_000]})

    assert offline.status_code == 409 and "is offline" in offline.json()["detail"]
    assert unknown.status_code == 404 and unknown.json()["detail"].startswith("node_ids.1:")


def test_create_run_stores_the_plan_and_sends_each_rank_to_its_node(online_node, client, dispatched):
    a, b = online_node("RTX 3090"), online_node("T4")

    run = _create(client, run_body([a, b], compression={"density": 0.02, "error_feedback": False})).json()

    assert run["status"] == "launching" and run["launched_at"] is not None
    # Rank 0 first: the others wait for the port it names (tests/app/test_ports.py).
    assert [(w["rank"], w["role"], w["status"]) for w in run["workers"]] == [
        (0, "ps", "launched"), (1, "worker", "planned"), (2, "worker", "planned")]
    assert [args[1] for _, args in dispatched.take(a.id) + dispatched.take(b.id)] == [0]
    a.event(run["id"], rank=0, role="ps", event="started", pid=1, port=40100)
    orders_a, orders_b = dispatched.take(a.id), dispatched.take(b.id)
    assert {task for task, _ in orders_a + orders_b} == {LAUNCH_ROLE}
    by_rank = {args[1]: args for _, args in orders_a + orders_b}
    assert sorted(by_rank) == [1, 2]
    assert {args[1] for _, args in orders_b} == {2}
    spec = by_rank[1][2]
    assert spec["world_size"] == 3 and spec["master_port"] == 40100
    assert spec["batch_sizes"] == [w["batch_size"] for w in run["workers"][1:]]
    assert spec["report_url"].endswith(f"/api/v1/runs/{run['id']}/metrics")
    assert spec["report_token"].startswith("htr_")
    train = spec["train_options"]
    assert train["strategy"] == "ps-bz-gc" and train["max_steps"] == 20
    assert train["task"] == "hybridtrain.tasks.digits:smallcnn" and train["task_args"] == {}
    assert spec["bundle"] is None and spec["script_args"] == []
    assert train["compression"] == {"density": 0.02, "error_feedback": False}
    assert spec["env"] == {"CUDA_VISIBLE_DEVICES": "0"}


def test_a_repeated_post_with_the_same_idempotency_key_makes_no_second_run(online_node, client, dispatched):
    a = online_node()
    body = run_body([a])

    first = _create(client, body, key="ci-build-42")
    dispatched.take(a.id)
    second = _create(client, body, key="ci-build-42")
    reused = client.post(f"{API}/runs", json={**body, "name": "other"}, headers={"Idempotency-Key": "ci-build-42"})

    assert first.status_code == 201 and second.status_code == 200
    assert second.json()["id"] == first.json()["id"]
    assert dispatched.take(a.id) == []  # no second launch
    assert reused.status_code == 409 and "used for a different request" in reused.json()["detail"]
    runs = client.get(f"{API}/runs").json()["data"]
    assert [r["id"] for r in runs].count(first.json()["id"]) == 1


def test_run_request_is_validated(online_node, client):
    a = online_node()
    both = client.post(f"{API}/runs", json={**run_body([a]), "cluster_id": 1})
    steps = client.post(f"{API}/runs", json={**run_body([a]), "epochs": 2})
    assert both.status_code == steps.status_code == 422


def test_epochs_without_a_profile_leave_max_steps_to_the_trainer(online_node, client, dispatched):
    a = online_node()
    body = {**run_body([a]), "epochs": 3}
    del body["max_steps"]

    plan = client.post(f"{API}/runs/plan", json=body).json()
    run = _create(client, body).json()

    assert plan["max_steps"] is None and plan["task"] is None
    assert run["max_steps"] is None and run["epochs"] == 3
    train = next(args[2]["train_options"] for _, args in dispatched.take(a.id) if args[1] == 0)
    assert train["epochs"] == 3 and "max_steps" not in train


def test_a_run_without_a_length_trains_the_default_steps(online_node, client):
    a = online_node()
    body = run_body([a])
    del body["max_steps"]
    assert client.post(f"{API}/runs/plan", json=body).json()["max_steps"] == 300


# -- lifecycle -----------------------------------------------------------------------------


def _two_rank_run(online_node, client):
    a, b = online_node(), online_node()
    run = _create(client, run_body([a, b], strategy="ps", ps_node_id=a.id)).json()
    return run, a, b


def test_role_events_drive_a_run_to_success(online_node, client, dispatched):
    run, a, b = _two_rank_run(online_node, client)
    rid = run["id"]

    for node, rank in ((a, 0), (a, 1), (b, 2)):
        answer = node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="started", pid=100 + rank)
        assert answer.status_code == 200, answer.text
    assert client.get(f"{API}/runs/{rid}").json()["status"] == "running"

    for node, rank in ((b, 2), (a, 1), (a, 0)):
        node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="exited", exit_code=0)
    done = client.get(f"{API}/runs/{rid}").json()

    assert done["status"] == "succeeded" and done["reason"] is None
    assert done["started_at"] and done["finished_at"]
    assert {w["status"] for w in done["workers"]} == {"succeeded"}
    assert [w["pid"] for w in done["workers"]] == [100, 101, 102]


def test_a_failing_rank_of_a_run_without_restarts_fails_it_with_its_reason_and_stops_the_others(
    online_node, client, dispatched
):
    a, b = online_node(), online_node()
    rid = _create(client, run_body([a, b], strategy="allreduce", max_restarts=0)).json()["id"]
    dispatched.take(a.id), dispatched.take(b.id)

    b.event(rid, rank=1, role="worker", event="exited", exit_code=1,
            reason="rank 1 (worker) exited with code 1: RuntimeError: boom")
    failed = client.get(f"{API}/runs/{rid}").json()

    assert failed["status"] == "failed"
    assert failed["reason"] == f"rank 1 (worker) exited with code 1: RuntimeError: boom on node {b.name}"
    assert [w["status"] for w in failed["workers"]] == ["cancelled", "failed"]
    assert dispatched.take(a.id) == [(CANCEL_RUN, [rid, failed["reason"]])]
    # A late start of a rank of the failed run is told to stop.
    late = a.event(rid, rank=0, role="worker", event="started", pid=9)
    assert late.json()["action"] == "stop"


def test_cancel_stops_every_node_and_a_second_cancel_conflicts(online_node, client, dispatched):
    run, a, b = _two_rank_run(online_node, client)
    rid = run["id"]
    dispatched.take(a.id), dispatched.take(b.id)

    cancelled = client.post(f"{API}/runs/{rid}/cancel", json={"reason": "not needed"})
    again = client.post(f"{API}/runs/{rid}/cancel")

    # Launched: it reads cancelling until the agents report its ranks gone.
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    assert cancelled.json()["reason"] == "not needed"
    assert dispatched.take(a.id) == [(CANCEL_RUN, [rid, "not needed"])]
    assert dispatched.take(b.id) == [(CANCEL_RUN, [rid, "not needed"])]
    assert again.status_code == 409
    # The agents' exit reports of the cancelled ranks end it cancelled.
    b.event(rid, rank=2, role="worker", event="exited", signal=15, cancelled=True, reason="stopped")
    assert client.get(f"{API}/runs/{rid}").json()["workers"][2]["signal"] == 15


def test_events_from_the_wrong_node_or_without_token_are_refused(online_node, client, make_client):
    run, a, b = _two_rank_run(online_node, client)
    wrong = b.event(run["id"], rank=0, role="ps", event="started")
    anonymous = make_client(None).post(f"{API}/agent/runs/{run['id']}/events",
                                       json={"rank": 0, "role": "ps", "event": "started"})
    admin = client.post(f"{API}/agent/runs/{run['id']}/events", json={"rank": 0, "role": "ps", "event": "started"})
    assert wrong.status_code == 409 and anonymous.status_code == 401 and admin.status_code == 401


# -- heartbeats and liveness ---------------------------------------------------------------


def test_heartbeat_lists_roles_of_ended_runs_to_stop(online_node, client, dispatched):
    run, a, b = _two_rank_run(online_node, client)
    client.post(f"{API}/runs/{run['id']}/cancel")

    beat = a.agent.post(f"{API}/agent/heartbeat", json={"roles": [
        {"run_id": run["id"], "rank": 1, "role": "worker", "pid": 5, "state": "running"}]})

    assert beat.status_code == 200
    assert beat.json()["stop"] == [{"run_id": run["id"], "rank": 1, "before_attempt": None,
                                    "reason": f"cancelled by {'HYBRIDTRAIN_ADMIN_TOKEN'}"}]


def test_heartbeat_carries_an_exit_whose_event_was_lost_and_the_run_goes_on_degraded(online_node, client, dispatched):
    run, a, b = _two_rank_run(online_node, client)
    rid = run["id"]

    a.agent.post(f"{API}/agent/heartbeat", json={"roles": [
        {"run_id": rid, "rank": 1, "role": "worker", "pid": 5, "state": "exited", "exit_code": 3,
         "reason": "rank 1 (worker) exited with code 3"}]})

    degraded = client.get(f"{API}/runs/{rid}").json()
    assert degraded["status"] == "degraded"
    assert degraded["workers"][1]["status"] == "failed"
    assert degraded["workers"][1]["reason"] == "rank 1 (worker) exited with code 3"


def test_a_worker_its_agent_no_longer_reports_degrades_the_run(online_node, client, dispatched, session):
    run, a, b = _two_rank_run(online_node, client)
    rid = run["id"]
    a.event(rid, rank=1, role="worker", event="started", pid=5)
    worker = next(w for w in get_run(session, run_id=rid).workers if w.rank == 1)
    worker.started_at = utcnow() - timedelta(minutes=5)
    session.commit()

    a.agent.post(f"{API}/agent/heartbeat", json={"roles": []})

    degraded = client.get(f"{API}/runs/{rid}").json()
    assert degraded["status"] == "degraded"
    assert degraded["workers"][1]["reason"] == f"rank 1 (worker) is no longer running on node {a.name} (agent restarted?)"


def test_a_node_silent_for_the_timeout_goes_offline_and_its_worker_is_lost(
    online_node, client, dispatched, session, settings
):
    run, a, b = _two_rank_run(online_node, client)
    rid = run["id"]
    dispatched.take(a.id), dispatched.take(b.id)
    later = utcnow() + timedelta(seconds=31)
    # Node a keeps beating; node b fell silent 31 s ago.
    session.get(Node, a.id).last_heartbeat = later

    check_liveness(session, settings=settings.model_copy(update={"heartbeat_timeout_s": 30}), now=later)
    session.commit()

    assert session.get(Node, b.id).status == NodeStatus.offline
    degraded = client.get(f"{API}/runs/{rid}").json()
    assert degraded["status"] == "degraded"
    lost = degraded["workers"][2]
    assert lost["status"] == "failed"
    assert lost["reason"].startswith(f"node {b.name} went offline: no heartbeat for 30 s")
    assert lost["reason"].endswith("rank 2 (worker) lost")
    # Its next heartbeat brings the node back online.
    assert b.agent.post(f"{API}/agent/heartbeat", json={"roles": []}).json()["status"] == "online"


def test_ranks_that_never_start_fail_the_run_after_the_launch_timeout(online_node, client, dispatched, session, settings):
    run, a, b = _two_rank_run(online_node, client)
    rid = run["id"]
    a.event(rid, rank=0, role="ps", event="started")
    a.event(rid, rank=1, role="worker", event="started")
    for node in session.scalars(select(Node).where(Node.id.in_([a.id, b.id]))):
        node.last_heartbeat = utcnow() + timedelta(seconds=200)

    timeouts = {"heartbeat_timeout_s": 30, "launch_timeout_s": 180, "launch_resend_s": 600}
    check_liveness(session, settings=settings.model_copy(update=timeouts), now=utcnow() + timedelta(seconds=181))
    session.commit()

    failed = client.get(f"{API}/runs/{rid}").json()
    assert failed["status"] == "failed"
    assert failed["reason"] == f"rank(s) 2 did not start within 180 s (on {b.name})"


def test_rebalancing_and_evaluation_period_reach_the_trainer(online_node, client, dispatched):
    a, b = online_node("RTX 3090"), online_node("T4")

    run = _create(client, run_body([a, b], rebalance_every=10, eval_every=5)).json()

    assert run["rebalance_every"] == 10 and run["eval_every"] == 5
    orders = dispatched.take(a.id) + dispatched.take(b.id)
    train = next(args[2]["train_options"] for _, args in orders if args[1] == 0)
    assert train["allocation"] == "measured" and train["rebalance_every"] == 10
    assert train["eval_every"] == 5


def test_a_run_that_trains_past_its_target_tells_the_trainer(online_node, client, dispatched):
    a, b = online_node("RTX 3090"), online_node("T4")

    run = _create(client, run_body([a, b], target="accuracy>=0.9", stop_at_target=False)).json()

    assert run["stop_at_target"] is False and run["target"] == "accuracy>=0.9"
    orders = dispatched.take(a.id) + dispatched.take(b.id)
    train = next(args[2]["train_options"] for _, args in orders if args[1] == 0)
    assert train["target"] == "accuracy>=0.9" and train["stop_at_target"] is False


def test_runs_stop_at_their_target_by_default(online_node, client, dispatched):
    a = online_node()

    run = _create(client, run_body([a], target="accuracy>=0.9")).json()

    assert run["stop_at_target"] is True
    train = next(args[2]["train_options"] for _, args in dispatched.take(a.id) if args[1] == 0)
    assert train["stop_at_target"] is True


def test_a_pipelined_ps_run_tells_the_trainer_its_chunks(online_node, client, dispatched):
    a = online_node()

    run = _create(client, run_body([a], strategy="ps-gc", compression={"pipeline_chunks": 4})).json()

    assert run["compression"]["pipeline_chunks"] == 4
    train = next(args[2]["train_options"] for _, args in dispatched.take(a.id) if args[1] == 0)
    assert train["compression"]["pipeline_chunks"] == 4


def test_only_parameter_server_runs_pipeline(online_node, client):
    a = online_node()
    body = run_body([a], strategy="allreduce", compression={"pipeline_chunks": 4})
    response = client.post(f"{API}/runs", json=body)
    assert response.status_code == 422 and "pipeline_chunks" in response.text


def test_only_parameter_server_runs_rebalance(online_node, client):
    a = online_node()
    response = client.post(f"{API}/runs", json=run_body([a], strategy="allreduce", rebalance_every=10))
    assert response.status_code == 422 and "rebalance_every" in response.text


def _options_by_rank(dispatched, nodes, key: str = "options") -> dict[int, dict]:
    """Each rank's trainer flags (`key` "options") or training options ("train_options")."""
    orders = [o for n in nodes for o in dispatched.take(n.id)]
    return {args[1]: args[2][key] for _, args in orders}


def _compression_by_rank(dispatched, nodes) -> dict[int, dict]:
    return {rank: train.get("compression", {})
            for rank, train in _options_by_rank(dispatched, nodes, "train_options").items()}


def test_a_ps_run_across_sites_tells_the_trainer_each_ranks_site(online_node, client, dispatched, make_site):
    onprem, cloud = make_site()["id"], make_site()["id"]
    a, b = online_node("RTX 3090 Ti", site_id=onprem), online_node("RTX 3090", site_id=onprem)
    c, d = online_node("V100 PCIe", site_id=cloud), online_node("V100 PCIe", site_id=cloud)

    run = _create(client, run_body([a, b, c, d])).json()

    site_of = {a.id: onprem, b.id: onprem, c.id: cloud, d.id: cloud}
    expected = ",".join(str(site_of[w["node_id"]]) for w in run["workers"])
    options = _options_by_rank(dispatched, [a, b, c, d])
    assert {o.get("sites") for o in options.values()} == {expected}


def test_a_run_within_one_site_needs_no_relay(online_node, client, dispatched, make_site):
    site = make_site()["id"]
    a, b = online_node("RTX 3090", site_id=site), online_node("T4", site_id=site)

    _create(client, run_body([a, b]))

    assert all("sites" not in o for o in _options_by_rank(dispatched, [a, b]).values())


def test_site_aggregation_is_sent_to_the_trainers_of_a_run_across_sites(online_node, client, dispatched, make_site):
    onprem, cloud = make_site()["id"], make_site()["id"]
    nodes = [online_node("RTX 3090", site_id=onprem), online_node("V100 PCIe", site_id=cloud),
             online_node("V100 PCIe", site_id=cloud)]

    _create(client, run_body(nodes, compression={"aggregate_at_sites": True}))

    orders = [args[2] for n in nodes for _, args in dispatched.take(n.id)]
    assert all(o["train_options"]["compression"]["aggregate_at_sites"] is True and "sites" in o["options"]
               for o in orders)


def test_site_aggregation_is_left_out_of_a_run_within_one_site(online_node, client, dispatched, make_site):
    site = make_site()["id"]
    a, b = online_node("RTX 3090", site_id=site), online_node("T4", site_id=site)

    _create(client, run_body([a, b], compression={"aggregate_at_sites": True}))

    assert all("aggregate_at_sites" not in c for c in _compression_by_rank(dispatched, [a, b]).values())


def test_overlap_is_no_longer_an_option(online_node, client):
    # Removed: sending chunks during the backward pass never paid (docs/CHANGELOG.md).
    response = client.post(f"{API}/runs", json=run_body([online_node()], compression={"overlap": True}))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "compression", "overlap"]


def test_apply_in_forward_is_sent_to_the_trainers(online_node, client, dispatched):
    a, b = online_node(), online_node()

    _create(client, run_body([a, b], compression={"apply_in_forward": True, "pipeline_chunks": 4}))

    assert all(c.get("apply_in_forward") is True for c in _compression_by_rank(dispatched, [a, b]).values())


@pytest.mark.parametrize("compression, says", [
    ({"apply_in_forward": True, "pipeline_chunks": 1}, "needs compression.pipeline_chunks"),
])
def test_apply_in_forward_where_it_cannot_work_is_refused(online_node, client, compression, says):
    response = client.post(f"{API}/runs", json=run_body([online_node()], compression=compression))
    assert response.status_code == 422 and says in response.text


def test_apply_in_forward_alone_takes_the_strategys_pipeline(online_node, client):
    # ps-bz-gc's default pipeline has several chunks (hybridtrain.strategy_defaults).
    assert default("ps-bz-gc", "compression.pipeline_chunks") > 1
    response = _create(client, run_body([online_node()], compression={"apply_in_forward": True}))
    assert response.json()["effective_options"]["compression"]["pipeline_chunks"] == default(
        "ps-bz-gc", "compression.pipeline_chunks")


def test_a_run_shows_the_options_it_runs_with_its_strategys_defaults_where_it_gave_none(online_node, client):
    run = _create(client, run_body([online_node()], strategy="ps-bz-gc", compression={"density": 0.01})).json()

    assert run["compression"] == {"density": 0.01}
    effective = run["effective_options"]
    assert effective == strategy_defaults.effective("ps-bz-gc", {"compression": {"density": 0.01}, "local_sgd": {},
                                                                 "rebalance_every": None})
    # What was given wins; a density given alone brings its own band; the rest are the table's.
    assert effective["compression"]["density"] == 0.01
    assert effective["compression"]["density_max"] == pytest.approx(0.02)
    assert effective["compression"]["pipeline_chunks"] == default("ps-bz-gc", "compression.pipeline_chunks")
    assert effective["rebalance_every"] == default("ps-bz-gc", "rebalance_every")


@pytest.mark.parametrize("flag", ["aggregate_at_sites", "apply_in_forward"])
def test_per_step_variants_and_site_aggregation_are_for_parameter_server_runs_only(online_node, client, flag):
    response = client.post(f"{API}/runs", json=run_body([online_node()], strategy="allreduce",
                                                        compression={flag: True}))
    assert response.status_code == 422 and f"compression.{flag}" in response.text


def test_a_diloco_run_tells_the_trainers_its_outer_steps(online_node, client, dispatched):
    a, b = online_node(), online_node()

    run = _create(client, run_body([a, b], strategy="diloco",
                                   local_sgd={"sync_every": 50, "outer_lr": 0.5, "outer_momentum": 0.8})).json()

    assert run["local_sgd"] == {"sync_every": 50, "outer_lr": 0.5, "outer_momentum": 0.8}
    trains = _options_by_rank(dispatched, [a, b], "train_options").values()
    assert trains and all(t["local_sgd"] == run["local_sgd"] for t in trains)


def test_an_asynchronous_streaming_diloco_run_is_accepted_with_both(online_node, client):
    run = _create(client, run_body([online_node()], strategy="diloco",
                                   local_sgd={"sync_every": 8, "asynchronous": True, "fragments": 4})).json()

    assert run["local_sgd"] == {"sync_every": 8, "asynchronous": True, "fragments": 4}


def test_local_sgd_knobs_under_compression_are_still_read_for_one_release(online_node, client):
    run = _create(client, run_body([online_node()], strategy="diloco-gc",
                                   compression={"sync_every": 10, "outer_density": 0.05, "value_dtype": "fp16"})).json()

    assert run["local_sgd"] == {"sync_every": 10, "outer_density": 0.05}
    assert run["compression"] == {"value_dtype": "fp16"}


def test_a_local_sgd_knob_given_in_both_places_is_refused(online_node, client):
    body = run_body([online_node()], strategy="diloco", compression={"sync_every": 10}, local_sgd={"sync_every": 5})
    response = client.post(f"{API}/runs", json=body)
    assert response.status_code == 422 and "local_sgd.sync_every" in response.text


@pytest.mark.parametrize("strategy, options, field", [
    ("ps-bz-gc", {"local_sgd": {"sync_every": 10}}, "local_sgd.sync_every"),
    ("allreduce", {"local_sgd": {"outer_lr": 0.5}}, "local_sgd.outer_lr"),
    ("ps-gc", {"local_sgd": {"outer_density": 0.2}}, "local_sgd.outer_density"),
    ("diloco", {"compression": {"aggregate_at_sites": True}}, "compression.aggregate_at_sites"),
    ("ps-bz-gc", {"local_sgd": {"site_replicas": True}}, "local_sgd.site_replicas"),
    ("diloco-gc", {"compression": {"apply_in_forward": True, "pipeline_chunks": 4}}, "compression.apply_in_forward"),
    ("allreduce", {"compression": {"pipeline_chunks": 2}}, "compression.pipeline_chunks"),
    ("ps-bz-gc", {"compression": {"powersgd_rank": 4}}, "compression.powersgd_rank"),
    ("allreduce", {"rebalance_every": 10}, "rebalance_every"),
    # An overlapped outer step must land before the next is due.
    ("diloco", {"local_sgd": {"sync_every": 5, "outer_delay": 5}}, "local_sgd.outer_delay"),
    ("diloco", {"local_sgd": {"outer_delay": 20}}, "local_sgd.outer_delay"),
    # Asynchronous outer steps: local SGD's only, instead of a fixed delay, bounded below H.
    ("ps-gc", {"local_sgd": {"asynchronous": True}}, "local_sgd.asynchronous"),
    ("diloco", {"local_sgd": {"asynchronous": True, "outer_delay": 3}}, "local_sgd.outer_delay"),
    ("diloco-gc", {"local_sgd": {"asynchronous": True, "site_replicas": True}}, "local_sgd.asynchronous"),
    ("diloco", {"local_sgd": {"max_staleness": 2}}, "local_sgd.max_staleness"),
    ("diloco", {"local_sgd": {"asynchronous": True, "sync_every": 5, "max_staleness": 5}}, "local_sgd.max_staleness"),
    # Streaming: local SGD only, at most one fragment's outer step an inner step, not with site
    # replicas (whose relays exchange whole outer steps).
    ("ps-bz-gc", {"local_sgd": {"fragments": 4}}, "local_sgd.fragments"),
    ("diloco", {"local_sgd": {"sync_every": 4, "fragments": 5}}, "local_sgd.fragments"),
    ("diloco-gc", {"local_sgd": {"fragments": 2, "site_replicas": True}}, "local_sgd.fragments"),
    # Accepted once, and then every rank refused it at start: ps compresses nothing.
    ("ps", {"compression": {"apply_in_forward": True, "pipeline_chunks": 4}}, "compression.apply_in_forward"),
    ("ps-gc", {"compression": {"apply_in_forward": True, "pipeline_chunks": 4, "compressor": "none"}},
     "compression.apply_in_forward"),
])
def test_options_the_strategy_does_not_take_are_refused_naming_the_field(online_node, client, strategy, options,
                                                                        field):
    response = client.post(f"{API}/runs", json=run_body([online_node()], strategy=strategy, **options))
    assert response.status_code == 422 and field in response.text
    assert response.json()["detail"][0]["loc"] == ["body", *field.split(".")]


# (request path, value, the trainer's flags for it): every option the compat table rules on.
_WALKED = [
    ("compression.pipeline_chunks", 4, ["--pipeline-chunks", "4"]),
    ("compression.apply_in_forward", True, ["--apply-in-forward"]),
    ("compression.momentum_correction", False, ["--no-momentum-correction"]),
    ("compression.compressor", "none", ["--compressor", "none"]),
    ("compression.powersgd_rank", 4, ["--powersgd-rank", "4"]),
    ("local_sgd.sync_every", 4, ["--sync-every", "4"]),
    ("local_sgd.outer_lr", 0.5, ["--outer-lr", "0.5"]),
    ("local_sgd.outer_momentum", 0.5, ["--outer-momentum", "0.5"]),
    ("local_sgd.outer_density", 0.2, ["--outer-density", "0.2"]),
    ("local_sgd.outer_delay", 5, ["--outer-delay", "5"]),
    ("local_sgd.asynchronous", True, ["--async-outer"]),
    ("local_sgd.max_staleness", 5, ["--max-staleness", "5"]),
    ("local_sgd.fragments", 4, ["--fragments", "4"]),
    ("rebalance_every", 10, ["--rebalance-every", "10"]),
]


def test_every_combination_the_api_accepts_the_trainer_accepts_too_and_both_doors_agree():
    # The API and the trainer's command line ask one table (hybridtrain.compat); what the API
    # accepts reaches the trainer as --options-json and makes the same TrainConfig as the flags.
    from itertools import combinations, product

    from app.schemas.runs import RunCreate
    from hybridtrain import contract
    from trainer.cli import UsageError, build_parser, config_from_args

    parser = build_parser()
    for strategy, size in product(contract.STRATEGIES, (0, 1, 2)):
        for chosen in combinations(_WALKED, size):
            body: dict = {}
            for path, value, _ in chosen:
                section, _, name = path.rpartition(".")
                (body.setdefault(section, {}) if section else body)[name] = value
            try:
                request = RunCreate(name="r", node_ids=[1], strategy=strategy, device="cpu", **body)
            except ValueError:
                request = None
            argv = ["--strategy", strategy, *[a for *_, flags in chosen for a in flags]]
            try:
                by_flags = config_from_args(parser.parse_args(argv), parser)
            except UsageError:
                by_flags = None
            assert (request is None) == (by_flags is None), (strategy, body)
            if request is not None:
                text = request.train_options().model_dump_json(exclude_none=True)
                by_json = config_from_args(parser.parse_args(["--options-json", text]), parser)
                assert by_json == by_flags, body
