"""Plans that ask for the profiles they lack (POST /runs/plan and /plans/optimize with
"profile_missing"), over the real Postgres and Redis: which nodes are ordered a profile, what the
plan says while they are measured, how old and noisy its inputs are, and scripts said plainly."""

from __future__ import annotations

from datetime import timedelta

from predictions_testing import RESULT, TASK, add_profile
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)
from sqlalchemy import select

from test_profiles import upload_bundle

from app.models import ProfileStatus, TaskProfile, TokenScope
from app.models.base import utcnow
from hybridtrain.contract import PROFILE_TASK


def _profiles(session, node_id: int) -> list[TaskProfile]:
    session.expire_all()
    return list(session.scalars(select(TaskProfile).where(TaskProfile.node_id == node_id)))


def _report(node, profile_id: int, **changes) -> None:  # type: ignore[no-untyped-def]
    response = node.agent.post(f"{API}/agent/profiles/{profile_id}",
                               json={"status": "done", "result": RESULT | changes})
    assert response.status_code == 200, response.text


def test_a_plan_orders_the_profile_of_its_task_from_the_nodes_that_lack_one(client, online_node, session, dispatched):
    profiled, bare = online_node(), online_node()
    add_profile(session, profiled.id)
    response = client.post(f"{API}/runs/plan", json=run_body([profiled, bare], task=TASK, profile_missing=True))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prediction"] is None
    [waiting] = body["profiling"]
    assert (waiting["node_id"], waiting["node_name"], waiting["status"]) == (bare.id, bare.name, "pending")
    [pending] = _profiles(session, bare.id)
    assert pending.id == waiting["profile_id"] and pending.task == TASK and pending.status is ProfileStatus.pending
    assert [task for task, _ in dispatched.take(bare.id)] == [PROFILE_TASK]
    assert dispatched.take(profiled.id) == [] and len(_profiles(session, profiled.id)) == 1


def test_asking_again_while_profiling_orders_nothing_more(client, online_node, session, dispatched):
    node = online_node()
    body = run_body([node], task=TASK, profile_missing=True, strategies="all")
    first = client.post(f"{API}/runs/plan", json=body).json()["plans"]
    again = client.post(f"{API}/runs/plan", json=body).json()["plans"]
    assert {p["profiling"][0]["profile_id"] for p in first + again} == {_profiles(session, node.id)[0].id}
    assert len(dispatched.take(node.id)) == 1


def test_once_the_agent_reports_the_plan_has_numbers_and_says_how_old_and_noisy_they_are(
    client, online_node, session, dispatched
):
    node = online_node()
    body = run_body([node], task=TASK, strategy="allreduce", profile_missing=True)
    profile_id = client.post(f"{API}/runs/plan", json=body).json()["profiling"][0]["profile_id"]
    _report(node, profile_id, spread=0.04, repeats=3, samples_per_s_runs=[498.0, 500.0, 518.0])
    answer = client.post(f"{API}/runs/plan", json=body).json()
    assert answer["profiling"] == [] and answer["prediction"]["samples_per_s"] > 0
    [given] = answer["inputs"]
    assert (given["node_id"], given["node_name"], given["profile_id"]) == (node.id, node.name, profile_id)
    assert (given["samples_per_s"], given["spread"], given["repeats"]) == (500.0, 0.04, 3)
    assert 0 <= given["age_s"] < 60
    stored = session.get(TaskProfile, profile_id)
    assert (stored.spread, stored.repeats) == (0.04, 3)
    assert stored.result["samples_per_s_runs"] == [498.0, 500.0, 518.0]


def test_a_failed_profile_is_reported_and_not_ordered_again_at_once(client, online_node, session, dispatched):
    node = online_node()
    body = run_body([node], task=TASK, profile_missing=True)
    profile_id = client.post(f"{API}/runs/plan", json=body).json()["profiling"][0]["profile_id"]
    failed = node.agent.post(f"{API}/agent/profiles/{profile_id}", json={"status": "failed", "error": "no module x"})
    assert failed.status_code == 200, failed.text
    [waiting] = client.post(f"{API}/runs/plan", json=body).json()["profiling"]
    assert (waiting["profile_id"], waiting["status"], waiting["error"]) == (profile_id, "failed", "no module x")
    assert len(_profiles(session, node.id)) == 1


def test_a_profile_pending_past_its_bound_is_taken_as_lost_and_ordered_again(client, online_node, session, dispatched):
    node = online_node()
    body = run_body([node], task=TASK, profile_missing=True)
    lost = client.post(f"{API}/runs/plan", json=body).json()["profiling"][0]["profile_id"]
    row = session.get(TaskProfile, lost)
    row.created_at = utcnow() - timedelta(hours=1)
    session.commit()
    [waiting] = client.post(f"{API}/runs/plan", json=body).json()["profiling"]
    assert waiting["profile_id"] != lost and waiting["status"] == "pending"


def test_without_profile_missing_a_plan_orders_nothing(client, online_node, session, dispatched):
    node = online_node()
    body = client.post(f"{API}/runs/plan", json=run_body([node], task=TASK)).json()
    assert body["profiling"] == [] and '"profile_missing": true' in body["prediction_unavailable"]
    assert _profiles(session, node.id) == [] and dispatched.take(node.id) == []


def test_a_script_plan_says_how_it_is_measured_and_orders_nothing(client, online_node, session, dispatched):
    node = online_node()
    sha, _ = upload_bundle(client)
    response = client.post(f"{API}/runs/plan", json=run_body(
        [node], script="train.py", bundle_sha256=sha, profile_missing=True))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prediction"] is None and body["profiling"] == []
    assert body["prediction_unavailable"].startswith("no measured step of script train.py")
    assert "a short run of it on these nodes" in body["prediction_unavailable"]
    assert _profiles(session, node.id) == []


def test_a_token_limited_to_plans_may_not_order_profiles(make_client, token_with_scope, online_node, session):
    node = online_node()
    limited = make_client(None)
    created = limited.post(f"{API}/tokens", json={"name": "planner", "scope": "ci", "actions": ["runs:plan"]},
                           headers={"Authorization": f"Bearer {token_with_scope(TokenScope.admin)}"})
    assert created.status_code == 201, created.text
    token = created.json()["token"]
    response = make_client(token).post(f"{API}/runs/plan", json=run_body([node], task=TASK, profile_missing=True))
    assert response.status_code == 403 and "profiles:write" in response.text
    assert _profiles(session, node.id) == []


def test_optimize_answers_202_with_the_nodes_being_profiled(client, online_node, session, dispatched):
    a, b = online_node(), online_node()
    add_profile(session, a.id)
    body = {"node_ids": [a.id, b.id], "task": TASK, "global_batch_size": 64, "profile_missing": True}
    response = client.post(f"{API}/plans/optimize", json=body)
    assert response.status_code == 202, response.text
    answer = response.json()
    assert [p["node_id"] for p in answer["profiling"]] == [b.id] and b.name in answer["detail"]
    _report(b, answer["profiling"][0]["profile_id"])
    done = client.post(f"{API}/plans/optimize", json=body)
    assert done.status_code == 200, done.text
    assert {i["node_id"] for i in done.json()["plan"]["inputs"]} <= {a.id, b.id}


def test_optimize_without_profile_missing_still_refuses_unprofiled_nodes(client, online_node):
    node = online_node()
    response = client.post(f"{API}/plans/optimize", json={"node_ids": [node.id], "task": TASK})
    assert response.status_code == 422


def test_a_pinned_servers_node_is_profiled_too(client, online_node, session, dispatched):
    worker, server = online_node(), online_node()
    add_profile(session, worker.id)
    body = run_body([worker], task=TASK, strategy="ps", ps_node_id=server.id, profile_missing=True)
    [waiting] = client.post(f"{API}/runs/plan", json=body).json()["profiling"]
    assert waiting["node_id"] == server.id
    assert [task for task, _ in dispatched.take(server.id)] == [PROFILE_TASK]
