"""Runs that train a task or a script in a code bundle: validation of what to train, the launch
orders that carry it, the planner's use of task profiles, and the step count a run given in
epochs learns from its trainer."""

from __future__ import annotations

import hashlib

import pytest
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.models import Bundle, ProfileStatus, TaskProfile
from app.models.base import utcnow
from app.queries.profiles import task_key

SHA = hashlib.sha256(b"bundle").hexdigest()


@pytest.fixture
def bundle(session) -> str:
    """A stored bundle's sha256 (its bytes do not matter to runs)."""
    session.add(Bundle(sha256=SHA, size_bytes=6, filename="code.tar.gz", files=1, created_by="admin",
                       content=b"bundle"))
    session.commit()
    return SHA


def _profile(session, node_id, *, task="hybridtrain.tasks.digits:smallcnn", task_args=None,
             samples_per_s=100.0, train_samples=1000, status=ProfileStatus.done):
    session.add(TaskProfile(
        node_id=node_id, task_key=task_key(task, task_args or {}, None), task=task,
        task_args=task_args or {}, batch_size=32, device="cpu", status=status, params=12345,
        train_samples=train_samples, eval_samples=100, samples_per_s=samples_per_s,
        metrics={"accuracy": True}, created_by="admin", measured_at=utcnow(),
    ))
    session.commit()


def _field_of(response) -> list:
    return [e["loc"][-1] for e in response.json()["detail"]]


def _worker_spec(dispatched, node) -> dict:
    return next(args[2] for _, args in dispatched.take(node.id) if args[1] == 0)


# -- validation ----------------------------------------------------------------------------


def test_a_malformed_task_reference_is_refused_naming_task(online_node, client):
    response = client.post(f"{API}/runs", json=run_body([online_node()], task="not a ref"))
    assert response.status_code == 422 and _field_of(response) == ["task"]


def test_task_args_must_be_a_json_object(online_node, client):
    response = client.post(f"{API}/runs", json=run_body([online_node()], task_args=[1, 2]))
    assert response.status_code == 422 and _field_of(response) == ["task_args"]


def test_task_args_over_64_kib_are_refused(online_node, client):
    response = client.post(f"{API}/runs", json=run_body([online_node()], task_args={"x": "a" * 70_000}))
    assert response.status_code == 422 and _field_of(response) == ["task_args"]


def test_a_malformed_bundle_sha256_is_refused(online_node, client):
    response = client.post(f"{API}/runs", json=run_body([online_node()], bundle_sha256="ABC"))
    assert response.status_code == 422 and _field_of(response) == ["bundle_sha256"]


def test_an_unknown_bundle_is_404_naming_bundle_sha256(online_node, client):
    response = client.post(f"{API}/runs/plan", json=run_body([online_node()], bundle_sha256="0" * 64))
    assert response.status_code == 404 and response.json()["detail"].startswith("bundle_sha256:")


def test_a_script_needs_a_bundle(online_node, client):
    response = client.post(f"{API}/runs", json=run_body([online_node()], script="train.py"))
    assert response.status_code == 422 and _field_of(response) == ["script"]


@pytest.mark.parametrize("path", ["/etc/train.py", "../train.py", "a/../../train.py", ""])
def test_a_script_path_must_stay_inside_the_bundle(online_node, client, bundle, path):
    response = client.post(f"{API}/runs", json=run_body([online_node()], bundle_sha256=bundle, script=path))
    assert response.status_code == 422 and _field_of(response) == ["script"]


def test_a_run_gives_a_task_or_a_script_not_both(online_node, client, bundle):
    body = run_body([online_node()], bundle_sha256=bundle, script="train.py", task="mycode:task")
    response = client.post(f"{API}/runs", json=body)
    assert response.status_code == 422 and _field_of(response) == ["script"]


def test_script_args_are_limited_to_64(online_node, client, bundle):
    body = run_body([online_node()], bundle_sha256=bundle, script="train.py", script_args=["x"] * 65)
    response = client.post(f"{API}/runs", json=body)
    assert response.status_code == 422 and _field_of(response) == ["script_args"]


@pytest.mark.parametrize("target", ["accuracy", "accuracy>0.9", "loss<=0.1", "accuracy>=nan"])
def test_a_malformed_target_is_refused_naming_target(online_node, client, target):
    response = client.post(f"{API}/runs", json=run_body([online_node()], target=target))
    assert response.status_code == 422 and _field_of(response) == ["target"]


def test_the_removed_hyperparameter_fields_are_refused(online_node, client):
    response = client.post(f"{API}/runs", json=run_body([online_node()], model="smallcnn", lr=0.1))
    assert response.status_code == 422 and sorted(_field_of(response)) == ["lr", "model"]


# -- what the run stores and the orders carry ----------------------------------------------


def test_a_task_run_stores_and_sends_its_task_args_and_target(online_node, client, dispatched):
    a = online_node()
    body = run_body([a], task="hybridtrain.tasks.shapes:widecnn", task_args={"lr": 0.05, "schedule": "constant"},
                    target="val_loss <= 0.3")

    run = client.post(f"{API}/runs", json=body).json()

    assert (run["task"], run["task_args"], run["target"]) == (
        "hybridtrain.tasks.shapes:widecnn", {"lr": 0.05, "schedule": "constant"}, "val_loss<=0.3")
    train = _worker_spec(dispatched, a)["train_options"]
    assert train["task"] == "hybridtrain.tasks.shapes:widecnn"
    assert train["task_args"] == {"lr": 0.05, "schedule": "constant"}
    assert train["target"] == "val_loss<=0.3"


def test_a_bundled_task_run_tells_the_agent_where_to_fetch_its_code(online_node, client, dispatched, bundle):
    a = online_node()

    run = client.post(f"{API}/runs", json=run_body([a], task="examples.diabetes:task", bundle_sha256=bundle)).json()

    assert run["bundle_sha256"] == bundle
    spec = _worker_spec(dispatched, a)
    assert spec["bundle"] == {"sha256": bundle, "path": f"/api/v1/runs/{run['id']}/bundle"}
    assert spec["train_options"]["task"] == "examples.diabetes:task"


def test_a_script_run_sends_the_script_and_its_args_instead_of_a_task(online_node, client, dispatched, bundle):
    a = online_node()
    body = run_body([a], bundle_sha256=bundle, script="train/main.py", script_args=["--epochs", "3"])

    run = client.post(f"{API}/runs", json=body).json()

    assert (run["script"], run["script_args"]) == ("train/main.py", ["--epochs", "3"])
    spec = _worker_spec(dispatched, a)
    assert spec["train_options"]["script"] == "train/main.py"
    assert spec["script_args"] == ["--epochs", "3"]


# -- task profiles in the plan ---------------------------------------------------------------


def test_measured_allocation_prefers_the_tasks_profiled_speed(online_node, client, session):
    a, b = online_node(samples_per_s=500.0), online_node(samples_per_s=500.0)
    _profile(session, a.id, samples_per_s=300.0)
    _profile(session, b.id, samples_per_s=100.0)

    plan = client.post(f"{API}/runs/plan", json=run_body([a, b], allocation="measured")).json()

    assert [w["batch_size"] for w in plan["workers"][1:]] == [48, 16]
    assert [w["speed"] for w in plan["workers"][1:]] == [300.0, 100.0]


def test_a_profile_of_other_task_args_is_not_used(online_node, client, session):
    a, b = online_node(samples_per_s=500.0), online_node(samples_per_s=100.0)
    _profile(session, a.id, task_args={"lr": 0.5}, samples_per_s=100.0)

    plan = client.post(f"{API}/runs/plan", json=run_body([a, b], allocation="measured")).json()

    assert [w["speed"] for w in plan["workers"][1:]] == [500.0, 100.0] and plan["task"] is None


def test_a_failed_profile_is_not_used(online_node, client, session):
    a = online_node(samples_per_s=500.0)
    _profile(session, a.id, samples_per_s=10.0, status=ProfileStatus.failed)

    plan = client.post(f"{API}/runs/plan", json=run_body([a], allocation="measured")).json()

    assert plan["workers"][1]["speed"] == 500.0


def test_the_plan_preview_shows_what_the_profiles_know_of_the_task(online_node, client, session):
    a, b = online_node(), online_node()
    _profile(session, a.id)

    plan = client.post(f"{API}/runs/plan", json=run_body([a, b])).json()

    assert plan["task"] == {"ref": "hybridtrain.tasks.digits:smallcnn", "params": 12345,
                            "train_samples": 1000, "profiled_nodes": [a.id]}


def test_epochs_become_steps_when_a_profile_knows_the_training_set(online_node, client, session):
    a = online_node()
    _profile(session, a.id, train_samples=1000)
    body = run_body([a], epochs=3)
    del body["max_steps"]

    run = client.post(f"{API}/runs", json=body).json()

    assert run["max_steps"] == 47  # ceil(3 * 1000 / 64)


# -- the step count learnt from the trainer ----------------------------------------------------


def _epoch_run(client, node):
    body = run_body([node], epochs=2)
    del body["max_steps"]
    response = client.post(f"{API}/runs", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"], response


def test_the_trainers_max_steps_metric_is_stored_on_a_run_given_in_epochs(
    online_node, client, make_client, dispatched
):
    a = online_node()
    run_id, _ = _epoch_run(client, a)
    token = _worker_spec(dispatched, a)["report_token"]

    stored = make_client(token).post(f"{API}/runs/{run_id}/metrics", json={"records": [
        {"rank": 0, "role": "ps", "step": 0, "t": 1.0, "name": "max_steps", "value": 46}]})

    assert stored.status_code == 200
    assert client.get(f"{API}/runs/{run_id}").json()["max_steps"] == 46


def test_a_known_max_steps_is_not_overwritten_by_a_report(online_node, client, make_client, dispatched):
    a = online_node()
    run = client.post(f"{API}/runs", json=run_body([a])).json()
    token = _worker_spec(dispatched, a)["report_token"]

    make_client(token).post(f"{API}/runs/{run['id']}/metrics", json={"records": [
        {"rank": 0, "role": "ps", "step": 0, "t": 1.0, "name": "max_steps", "value": 999}]})

    assert client.get(f"{API}/runs/{run['id']}").json()["max_steps"] == 20
