"""End to end on this machine: the control plane and three agents as separate processes, the
real trainer, Postgres and Redis; runs launched, cancelled and broken over REST."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest
from conftest import ADMIN, Deployment, group_alive, wait_until

pytestmark = pytest.mark.e2e

FINISHED = {"succeeded", "failed", "cancelled"}
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
    assert done["status"] == "succeeded", (done, cluster.get(f"/runs/{run['id']}/logs", params={"tail": 15}))
    # The run succeeds with its server; the workers leave after its goodbye, within moments.
    def all_exited():
        now = cluster.run(run["id"])
        return now if all(w["exit_code"] is not None for w in now["workers"]) else None

    ended = wait_until(all_exited, 60, "every rank's exit")
    assert all(w["exit_code"] == 0 for w in ended["workers"]), [
        (w["rank"], w["status"], w["exit_code"], w["reason"]) for w in ended["workers"]]
    assert cluster.get("/runs", params={"limit": 100})["count"] == 1  # the repeat made no run

    metrics = cluster.get(f"/runs/{run['id']}/metrics", params={"name": ["batch_size", "loss"]})
    batch = {s["rank"]: sorted(s["points"]) for s in metrics["series"] if s["name"] == "batch_size"}
    # Each worker started with its planned share (ps-bz-gc then re-splits from measured times by
    # default); the server reports the sum at every step.
    assert {rank: batch[rank][0][2] for rank in planned} == {rank: float(size) for rank, size in planned.items()}
    assert {p[2] for p in batch[0]} == {64.0}
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
    # The same nodes again: it queues behind the running run's GPUs.
    queued = _launch(cluster, "e2e-after-cancel", max_steps=100_000)
    assert cluster.run(queued["id"])["status"] == "queued"

    answer = cluster.post(f"/runs/{run['id']}/cancel", {"reason": "e2e cancel"})
    cancelled_at = time.monotonic()
    assert answer.status_code == 200 and answer.json()["status"] == "cancelling"

    # The roles end within about 2 s of their SIGTERM (trainer.stopping), well inside the
    # agents' kill grace (5 s here): none waits for a SIGKILL. Meanwhile the run holds its
    # GPUs: the queued run starts only once every role is gone and reported.
    seen: set[str] = set()
    while any(group_alive(g) for g in groups):
        seen.add(cluster.run(run["id"])["status"])
        assert cluster.run(queued["id"])["status"] == "queued", "the queued run started before the roles ended"
        assert time.monotonic() - cancelled_at < 4.5, "a role outlived SIGTERM by more than 4.5 s"
        time.sleep(0.1)
    final = cluster.wait_status(run["id"], {"cancelled"}, timeout=15)
    assert seen <= {"cancelling", "cancelled"}
    assert final["reason"] == "e2e cancel" and all(w["status"] == "cancelled" for w in final["workers"])
    assert all(w["exit_code"] is not None or w["signal"] for w in final["workers"])
    assert not any(w["signal"] == signal.SIGKILL for w in final["workers"]), final["workers"]

    started = cluster.wait_status(queued["id"], {"launching", "running", "degraded", "failed"}, timeout=30)
    assert datetime.fromisoformat(started["launched_at"]) >= datetime.fromisoformat(final["finished_at"])
    done = _cli(cluster, "runs", "cancel", str(queued["id"]), "--wait", "--timeout", "60")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "cancelled"


def _server_step(cluster: Deployment, run_id: int) -> int:
    series = cluster.get(f"/runs/{run_id}/metrics", params={"name": "loss", "rank": 0})["series"]
    return max((point[0] for one in series for point in one["points"]), default=0)


def test_a_workers_agent_killed_mid_run_degrades_the_run_which_trains_on(cluster: Deployment):
    run = _launch(cluster, "e2e-agent-killed", max_steps=100_000)
    running = cluster.wait_status(run["id"], {"running", "failed"}, timeout=120)
    assert running["status"] == "running", running["reason"]
    victim = cluster.nodes[2]
    lost_rank = next(w["rank"] for w in running["workers"] if w["node_id"] == victim)
    victim_name = next(w["node_name"] for w in running["workers"] if w["node_id"] == victim)
    # Mid-run: every worker has connected and trained (a fresh run waits up to --start-wait-s
    # for a worker lost before it connected).
    wait_until(lambda: _server_step(cluster, run["id"]) > 0, 120, "the first step")

    cluster.agents[victim].stop(signal.SIGKILL)

    degraded = cluster.wait_status(run["id"], {"degraded", "restarting", "failed", "succeeded", "cancelled"}, timeout=60)
    assert degraded["status"] == "degraded", degraded["reason"]
    lost = next(w for w in degraded["workers"] if w["rank"] == lost_rank)
    # Whichever noticed first (its node's heartbeats stopping, or the role's own end), the
    # reason names the lost rank or its node.
    assert lost["status"] in ("failed", "left", "cancelled")
    assert f"rank {lost_rank}" in (lost["reason"] or "") or victim_name in (lost["reason"] or ""), lost["reason"]
    offline = wait_until(lambda: cluster.get(f"/nodes/{victim}")["status"] == "offline", 30, "the node to go offline")
    assert offline
    # The server trains on with the workers that are left.
    steps = _server_step(cluster, run["id"])
    wait_until(lambda: _server_step(cluster, run["id"]) > steps, 60, "the server to train on")
    assert cluster.run(run["id"])["status"] == "degraded"

    cluster.post(f"/runs/{run['id']}/cancel", {"reason": "e2e done"})
    survivors = [w["pid"] for w in running["workers"] if w["pid"] and w["node_id"] != victim]
    wait_until(lambda: not any(group_alive(g) for g in survivors), 30, "every surviving role of the run to be gone")


def _cli(cluster: Deployment, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "HYBRIDTRAIN_URL": cluster.url, "HYBRIDTRAIN_TOKEN": ADMIN}
    return subprocess.run([sys.executable, "-m", "app.cli", *argv], env=env, cwd=cluster.cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_for_ci_exit_status_says_whether_the_run_succeeded(cluster: Deployment):
    # The two on-prem nodes: the cloud node's agent may have been killed by the test above.
    nodes = ",".join(str(n) for n in cluster.nodes[:2])
    # --no-profile: the plan's shape is what is checked here, not a profile of the task.
    plan = _cli(cluster, "runs", "create", "--name", "cli-plan", "--nodes", nodes, "--plan-only", "--no-profile")
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


def test_a_server_killed_mid_run_is_restarted_from_its_checkpoint_and_the_run_succeeds(cluster: Deployment):
    # Steps to spare: on an idle host 80 were done by the time the first checkpoint was listed,
    # and under the full suite's load once all of 240, once all of 600 (an upload retried with
    # backoff while the run went on; the kill then found the run over).
    run = _launch(cluster, "e2e-server-killed", max_steps=1500, checkpoint_every=10, max_restarts=2,
                  node_ids=cluster.nodes[:2])
    checkpointed = wait_until(lambda: (r := cluster.run(run["id"]))["latest_checkpoint"] and r, 180,
                              "a first checkpoint")
    assert checkpointed["status"] == "running", checkpointed["reason"]
    server = next(w for w in checkpointed["workers"] if w["role"] == "ps")

    os.killpg(server["pid"], signal.SIGKILL)

    # The restart counts, whether or not a poll catches the run in `restarting` (it lasts as long
    # as the new server takes to start).
    restarted = wait_until(lambda: ((r := cluster.run(run["id"]))["restarts"] or r["status"] in FINISHED) and r,
                           60, "the run to restart")
    done = cluster.wait_status(run["id"], FINISHED, timeout=300)
    assert done["status"] == "succeeded", done["reason"]
    events = cluster.get(f"/runs/{run['id']}/events")["events"]
    assert done["restarts"] == 1 and [e["kind"] for e in events].count("restart") == 1, (restarted, events)
    assert not group_alive(server["pid"])
