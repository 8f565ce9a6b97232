"""End to end on this machine: the control plane and three agents as separate processes, the
real trainer, Postgres and Redis; runs launched, cancelled and broken over REST."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import ADMIN, Deployment, group_alive, wait_until

pytestmark = pytest.mark.e2e

RUN = {"strategy": "ps-bz-gc", "task": "hybridtrain.tasks.digits:smallcnn", "task_args": {"lr": 0.1},
       "global_batch_size": 64, "device": "cpu"}


def _launch(cluster: Deployment, name: str, key: str | None = None, **fields) -> dict:
    body = {**RUN, "name": name, "node_ids": cluster.nodes, **fields}
    headers = {"Idempotency-Key": key} if key else {}
    response = cluster.post("/runs", body, headers=headers)
    assert response.status_code in (200, 201), response.text
    return response.json()


def _role_groups(run: dict) -> list[int]:
    # The pid an agent reports is its role guard's, which leads the role's process group.
    return [w["pid"] for w in run["workers"] if w["pid"]]


def test_ps_bz_gc_run_succeeds_with_metrics_and_planned_batch_sizes(cluster: Deployment):
    run = _launch(cluster, "e2e-success", key="e2e-success-1", max_steps=15)
    planned = {w["rank"]: w["batch_size"] for w in run["workers"] if w["role"] == "worker"}
    # Three workers on three GPU models: the 3090 Ti gets the most, the V100 the least.
    assert run["workers"][0]["role"] == "ps" and run["ps_node_id"] in cluster.nodes[:2]
    assert sum(planned.values()) == 64 and planned[1] > planned[2] > planned[3]

    repeat = cluster.post("/runs", {**RUN, "name": "e2e-success", "node_ids": cluster.nodes, "max_steps": 15},
                          headers={"Idempotency-Key": "e2e-success-1"})
    assert repeat.status_code == 200 and repeat.json()["id"] == run["id"]

    done = cluster.wait_status(run["id"], {"succeeded", "failed", "cancelled"}, timeout=240)
    assert done["status"] == "succeeded", done["reason"]
    assert all(w["exit_code"] == 0 for w in done["workers"])
    assert cluster.get("/runs", params={"limit": 100})["count"] == 1  # the repeat made no run

    metrics = cluster.get(f"/runs/{run['id']}/metrics", params={"name": ["batch_size", "loss"]})
    batch = {s["rank"]: {p[2] for p in s["points"]} for s in metrics["series"] if s["name"] == "batch_size"}
    # Each worker trained with its planned share at every step; the server reports the sum.
    assert {rank: batch[rank] for rank in planned} == {rank: {float(size)} for rank, size in planned.items()}
    assert batch[0] == {64.0}
    losses = {s["rank"]: s["count"] for s in metrics["series"] if s["name"] == "loss"}
    assert set(planned) <= set(losses) and min(losses[r] for r in planned) >= 10
    logs = cluster.get(f"/runs/{run['id']}/logs")["lines"]
    assert {line["rank"] for line in logs} >= {0}


def test_cancel_leaves_no_process_behind(cluster: Deployment):
    run = _launch(cluster, "e2e-cancel", max_steps=100_000)
    running = cluster.wait_status(run["id"], {"running", "failed"}, timeout=120)
    assert running["status"] == "running", running["reason"]
    groups = _role_groups(running)
    assert len(groups) == 4 and all(group_alive(g) for g in groups)

    answer = cluster.post(f"/runs/{run['id']}/cancel", {"reason": "e2e cancel"})
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"

    wait_until(lambda: not any(group_alive(g) for g in groups), 30, "every role of the run to be gone")
    # Every agent reported how its ranks ended.
    def reported() -> dict | None:
        current = cluster.run(run["id"])
        ended = all(w["exit_code"] is not None or w["signal"] for w in current["workers"])
        return current if ended else None

    final = wait_until(reported, 30, "the exit reports of every rank")
    assert final["status"] == "cancelled" and final["reason"] == "e2e cancel"


def test_an_agent_killed_mid_run_fails_the_run_with_the_reason(cluster: Deployment):
    run = _launch(cluster, "e2e-agent-killed", max_steps=100_000)
    running = cluster.wait_status(run["id"], {"running", "failed"}, timeout=120)
    assert running["status"] == "running", running["reason"]
    groups = _role_groups(running)
    victim = cluster.nodes[2]
    victim_name = next(w["node_name"] for w in running["workers"] if w["node_id"] == victim)

    cluster.agents[victim].stop(signal.SIGKILL)

    failed = cluster.wait_status(run["id"], {"failed", "succeeded", "cancelled"}, timeout=60)
    assert failed["status"] == "failed"
    # Whichever noticed first (the server losing rank 3, or the node's heartbeats stopping),
    # the reason names the lost rank or its node.
    assert "rank 3" in failed["reason"] or victim_name in failed["reason"], failed["reason"]
    wait_until(lambda: not any(group_alive(g) for g in groups), 30, "every role of the run to be gone")
    offline = wait_until(lambda: cluster.get(f"/nodes/{victim}")["status"] == "offline", 30, "the node to go offline")
    assert offline


def _cli(cluster: Deployment, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "HYBRIDTRAIN_URL": cluster.url, "HYBRIDTRAIN_TOKEN": ADMIN}
    return subprocess.run([sys.executable, "-m", "app.cli", *argv], env=env, cwd=cluster.cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_for_ci_exit_status_says_whether_the_run_succeeded(cluster: Deployment):
    # The two on-prem nodes: the cloud node's agent may have been killed by the test above.
    nodes = ",".join(str(n) for n in cluster.nodes[:2])
    plan = _cli(cluster, "runs", "create", "--name", "cli-plan", "--nodes", nodes, "--plan-only")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["world_size"] == 3

    # An argument the task does not take: every worker fails as it loads the task.
    failing = _cli(cluster, "runs", "create", "--name", "cli-fail", "--nodes", nodes,
                   "--task-args", '{"no_such_arg": 1}', "--max-steps", "3", "--device", "cpu",
                   "--wait", "--timeout", "200")
    assert failing.returncode == 1, failing.stderr
    run = json.loads(failing.stdout)
    assert run["status"] == "failed" and "exited with code" in run["reason"]
    assert "no_such_arg" in run["reason"], run["reason"]

    shown = _cli(cluster, "runs", "get", str(run["id"]))
    assert shown.returncode == 0 and json.loads(shown.stdout)["id"] == run["id"]
    again = _cli(cluster, "runs", "cancel", str(run["id"]))
    assert again.returncode == 1 and "already ended" in again.stderr
    listing = _cli(cluster, "nodes", "list")
    assert listing.returncode == 0 and listing.stdout.count("online") >= 2
    assert "warning: declared 1x RTX 3090 Ti but the agent detected no GPU" in listing.stdout
    unreachable = subprocess.run(
        [sys.executable, "-m", "app.cli", "runs", "get", "1", "--server", "http://127.0.0.1:9", "--token", "x"],
        capture_output=True, text=True, timeout=60, cwd=cluster.cwd,
    )
    assert unreachable.returncode == 4
