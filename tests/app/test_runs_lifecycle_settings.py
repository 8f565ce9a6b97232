"""A run's checkpoint, restart and membership settings: on by default from the API, given per
run, validated with a 422 naming the field, and sent to every rank."""

from __future__ import annotations

import pytest

from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from agents.celery_app import LAUNCH_ROLE


def test_runs_from_the_api_checkpoint_and_restart_by_default(online_node, client, dispatched):
    a = online_node()

    run = client.post(f"{API}/runs", json=run_body([a], strategy="allreduce")).json()

    assert (run["checkpoint_every"], run["checkpoint_every_s"]) == (100, 600.0)
    assert (run["max_restarts"], run["restarts"], run["min_workers"], run["min_workers_wait_s"]) == (3, 0, 1, 300.0)
    assert run["latest_checkpoint"] is None
    spec = next(args[2] for task, args in dispatched.take(a.id) if task == LAUNCH_ROLE)
    assert spec["options"]["checkpoint-every"] == 100 and spec["options"]["checkpoint-every-s"] == 600.0
    assert spec["checkpoint_url"].endswith(f"/api/v1/runs/{run['id']}/checkpoint")


def test_the_settings_given_reach_the_run_and_its_ranks(online_node, client, dispatched):
    a, b = online_node(), online_node()
    body = run_body([a, b], strategy="ps", ps_node_id=a.id, checkpoint_every=0, checkpoint_every_s=120,
                    max_restarts=1, min_workers=2, min_workers_wait_s=30)

    run = client.post(f"{API}/runs", json=body).json()

    assert (run["checkpoint_every"], run["checkpoint_every_s"], run["max_restarts"]) == (0, 120.0, 1)
    a.event(run["id"], rank=0, role="ps", event="started", pid=1)  # the others follow rank 0
    spec = next(args[2] for task, args in dispatched.take(b.id) if task == LAUNCH_ROLE)
    assert "checkpoint-every" not in spec["options"] and spec["options"]["checkpoint-every-s"] == 120.0
    assert spec["options"]["min-workers"] == 2 and spec["options"]["min-workers-wait-s"] == 30.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("checkpoint_every", -1), ("checkpoint_every_s", -5), ("max_restarts", -1), ("min_workers", 0),
     ("min_workers_wait_s", -1)],
)
def test_negative_settings_are_refused_naming_the_field(online_node, client, field, value):
    answer = client.post(f"{API}/runs", json=run_body([online_node()], **{field: value}))

    assert answer.status_code == 422
    assert field in str(answer.json()["detail"])


def test_more_min_workers_than_workers_is_refused_naming_the_field(online_node, client, dispatched):
    a, b = online_node(), online_node()

    answer = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id, min_workers=3))

    assert answer.status_code == 422
    assert "min_workers 3 is more than the run's 2 worker(s)" in str(answer.json())
