"""The step times that runs measure refresh their nodes' profiles (app.queries.run_profiles),
over the real Postgres and Redis: a succeeded run's workers' measured compute becomes each
node's newest profile of the run's task (or script), marked as from the run, the next plan
leans on it and says so, and a script gets a prediction once it has run."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from predictions_testing import RESULT, TASK, add_profile
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)
from sqlalchemy import select
from test_profiles import upload_bundle

from agents.celery_app import LAUNCH_ROLE
from app.cli.profile_commands import inputs_text
from app.models import ProfileStatus, TaskProfile
from app.queries.profiles import profiled_as, task_key

T0 = 1_800_000_000.0


def _launch(client, dispatched, make_client, nodes, **fields):  # type: ignore[no-untyped-def]
    """A run over `nodes`, started; its id, its ranks by node and a trainer client per rank."""
    created = client.post(f"{API}/runs", json=run_body(nodes, **fields))
    assert created.status_code == 201, created.text
    run = created.json()
    trainers: dict = {}
    while len(trainers) < len(run["workers"]):  # a PS run's workers are launched once its server started
        launched = {args[1]: (node, make_client(args[2]["report_token"]), args[2]["role"])
                    for node in nodes for task, args in dispatched.take(node.id) if task == LAUNCH_ROLE}
        assert launched, f"no launch order for ranks {set(w['rank'] for w in run['workers']) - set(trainers)}"
        for rank, (node, _, role) in launched.items():
            started = node.event(run["id"], rank=rank, role=role, event="started", pid=100 + rank)
            assert started.status_code == 200, started.text
        trainers |= launched
    return run, trainers


def _steps(trainer: TestClient, run_id: int, rank: int, computes: list[float], batch: int) -> None:
    records = []
    for step, compute in enumerate(computes, start=1):
        records += [{"rank": rank, "role": "worker", "step": step, "t": T0 + step, "name": "compute_s", "value": compute},
                    {"rank": rank, "role": "worker", "step": step, "t": T0 + step, "name": "batch_size", "value": batch}]
    answer = trainer.post(f"{API}/runs/{run_id}/metrics", json={"records": records})
    assert answer.status_code == 200, answer.text


def _exit(trainers, run_id: int, rank: int) -> None:  # type: ignore[no-untyped-def]
    node, _, role = trainers[rank]
    answer = node.event(run_id, rank=rank, role=role, event="exited", exit_code=0, pid=100 + rank)
    assert answer.status_code == 200, answer.text


def _profiles(session, node_id: int) -> list[TaskProfile]:  # type: ignore[no-untyped-def]
    session.expire_all()
    return list(session.scalars(select(TaskProfile).where(TaskProfile.node_id == node_id).order_by(TaskProfile.id)))


# Three warm-up steps (dropped), then 32 samples in 0.1 s (320 samples/s) or 0.08 s (400).
WARM_AND_STEADY = [1.0, 0.5, 0.3] + [0.1, 0.08] * 5


def test_a_succeeded_runs_measured_steps_become_each_nodes_newest_profile(
    client, online_node, session, dispatched, make_client
):
    node = online_node()
    add_profile(session, node.id, samples_per_s=500.0)
    run, trainers = _launch(client, dispatched, make_client, [node], task=TASK, strategy="allreduce",
                            global_batch_size=32)
    _steps(trainers[0][1], run["id"], 0, WARM_AND_STEADY, 32)
    _exit(trainers, run["id"], 0)

    old, new = _profiles(session, node.id)
    assert new.status is ProfileStatus.done and new.created_by == f"run {run['id']}"
    assert new.task_key == old.task_key and new.batch_size == 32
    assert new.samples_per_s == pytest.approx(360.0)  # the median step, the warm-up left out
    assert new.repeats == 10 and new.spread == pytest.approx((400 - 320) / 360)
    assert (new.result["source"], new.result["run_id"]) == ("run", run["id"])
    # The task's size and compression costs are the profiler's: a run does not measure them.
    assert {k: new.result[k] for k in ("params", "dense_params", "worker_compress_s")} == \
           {k: RESULT[k] for k in ("params", "dense_params", "worker_compress_s")}


def test_the_next_plan_uses_the_runs_figure_and_says_where_it_comes_from(
    client, online_node, session, dispatched, make_client
):
    node = online_node()
    add_profile(session, node.id, samples_per_s=500.0)
    run, trainers = _launch(client, dispatched, make_client, [node], task=TASK, strategy="allreduce",
                            global_batch_size=32)
    _steps(trainers[0][1], run["id"], 0, [1.0] * 3 + [0.1] * 6, 32)
    _exit(trainers, run["id"], 0)

    plan = client.post(f"{API}/runs/plan", json=run_body([node], task=TASK, strategy="allreduce")).json()
    [given] = plan["inputs"]
    assert (given["samples_per_s"], given["source"], given["run_id"], given["repeats"]) == (320.0, "run", run["id"], 6)
    assert 0 <= given["age_s"] < 60
    assert f"320.0 samples/s ±0.0 % (spread 0.0 % over 6 steps), measured" in inputs_text(plan)
    assert f"by run {run['id']}'s steps" in inputs_text(plan)


def test_a_ps_workers_steps_count_once_it_leaves_after_the_servers_goodbye(
    client, online_node, session, dispatched, make_client
):
    server, worker = online_node(), online_node()
    add_profile(session, server.id)
    add_profile(session, worker.id)
    run, trainers = _launch(client, dispatched, make_client, [server, worker], task=TASK, ps_node_id=server.id)
    worker_rank = next(r for r, (n, _, role) in trainers.items() if role == "worker" and n.id == worker.id)
    _exit(trainers, run["id"], 0)  # the server ends the run first
    before = len(_profiles(session, worker.id))
    _steps(trainers[worker_rank][1], run["id"], worker_rank, [1.0] * 3 + [0.2] * 5, 16)
    _exit(trainers, run["id"], worker_rank)
    profiles = _profiles(session, worker.id)
    assert len(profiles) == before + 1
    assert (profiles[-1].samples_per_s, profiles[-1].created_by) == (80.0, f"run {run['id']}")


def test_a_run_that_did_not_succeed_or_measured_too_few_steps_leaves_profiles_alone(
    client, online_node, session, dispatched, make_client
):
    failed_node, short_node = online_node(), online_node()
    failed, trainers = _launch(client, dispatched, make_client, [failed_node], task=TASK, strategy="allreduce")
    _steps(trainers[0][1], failed["id"], 0, [0.1] * 10, 64)
    answer = failed_node.event(failed["id"], rank=0, role="worker", event="exited", exit_code=1, pid=100)
    assert answer.status_code == 200, answer.text
    short, trainers = _launch(client, dispatched, make_client, [short_node], task=TASK, strategy="allreduce")
    _steps(trainers[0][1], short["id"], 0, [0.1] * 5, 64)  # 2 steps after the warm-up
    _exit(trainers, short["id"], 0)
    assert _profiles(session, failed_node.id) == [] and _profiles(session, short_node.id) == []


def test_a_script_plan_says_what_measures_it_and_predicts_once_it_has_run(
    client, online_node, session, dispatched, make_client
):
    server, worker = online_node(), online_node()
    sha, _ = upload_bundle(client)
    script = {"script": "train.py", "bundle_sha256": sha, "script_args": ["--epochs", "3"]}
    before = client.post(f"{API}/runs/plan", json=run_body([server, worker], **script, profile_missing=True)).json()
    assert before["prediction"] is None and before["profiling"] == []
    why = before["prediction_unavailable"]
    assert why.startswith("no measured step of script train.py") and "measured by running it" in why
    assert f"--nodes {server.id},{worker.id} --workdir . --script train.py --max-steps 30 -- --epochs 3" in why

    run, trainers = _launch(client, dispatched, make_client, [server, worker], **script, ps_node_id=server.id)
    server_trainer = next(t for _, t, role in trainers.values() if role == "ps")
    records = [{"rank": 0, "role": "ps", "step": 1, "t": T0, "name": "params", "value": 1_000_000}]
    assert server_trainer.post(f"{API}/runs/{run['id']}/metrics", json={"records": records}).status_code == 200
    for rank, (_, trainer, role) in trainers.items():
        if role == "worker":
            _steps(trainer, run["id"], rank, [1.0] * 3 + [0.1] * 5, 32)
    _exit(trainers, run["id"], 0)
    for rank, (_, _, role) in trainers.items():
        if role == "worker":
            _exit(trainers, run["id"], rank)

    ref, args = profiled_as(task="x:y", task_args={}, script="train.py", script_args=["--epochs", "3"])
    [measured] = [p for p in _profiles(session, worker.id) if p.task_key == task_key(ref, args, sha)]
    assert (measured.task, measured.result["params"], measured.result["dense_params"]) == \
           ("script:train.py", 1_000_000, 0)
    after = client.post(f"{API}/runs/plan", json=run_body([server, worker], **script)).json()
    assert after["prediction"]["samples_per_s"] > 0, after["prediction_unavailable"]
    assert {i["source"] for i in after["inputs"]} == {"run"}
