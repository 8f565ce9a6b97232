"""The same flow on the embedded defaults behind `make run`: `hybridtrain local` (SQLite
database, SQLite broker, its own agent for this machine) plus two more agents joined to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from conftest import ADMIN, ROOT, Deployment, _base_env, free_port, group_alive, wait_until

pytestmark = pytest.mark.e2e

EMBEDDED_BROKER = "sqla+sqlite:///./var/broker.db"


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("e2e-local")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # No DATABASE_URL, no CELERY_BROKER_URL: everything lands under ./var/ of the working dir.
    deployment = Deployment(tmp, _base_env(), url, cwd=tmp)
    try:
        server = deployment.start(["local", "--port", str(port), "--log-level", "warning"], "local")
        deployment.local = server  # type: ignore[attr-defined]

        def registered() -> list[dict]:
            if server.proc.poll() is not None:
                pytest.fail(f"hybridtrain local exited:\n{server.output()[-3000:]}")
            try:
                nodes = httpx.get(url + "/api/v1/nodes", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=2)
            except httpx.HTTPError:
                return []
            data = nodes.json()["data"] if nodes.status_code == 200 else []
            return data if data and data[0]["status"] == "online" else []

        here = wait_until(registered, 120, "hybridtrain local to register this machine")[0]
        wait_until(lambda: "agent ready" in server.output(), 60, "the local agent's worker")
        # This machine has no GPU; declare one so the three nodes differ as in the paper. The
        # node then shows the mismatch, and the planner uses the declared model.
        patched = deployment.api.patch(f"/nodes/{here['id']}", json={"gpus": [{"model": "RTX 3090 Ti", "count": 1}]})
        assert patched.status_code == 200, patched.text
        site = here["site_id"]
        deployment.nodes = [  # type: ignore[attr-defined]
            here["id"],
            deployment.add_node(site, "RTX 3090", broker_url=EMBEDDED_BROKER),
            deployment.add_node(site, "V100 PCIe", broker_url=EMBEDDED_BROKER),
        ]
        deployment.wait_online(deployment.nodes)  # type: ignore[attr-defined]
        yield deployment
    finally:
        deployment.close()


def test_local_registers_this_machine_and_shows_the_gpu_mismatch(local: Deployment):
    # The warning follows the declared GPUs edited above at the node's next heartbeat.
    here = wait_until(
        lambda: (n := local.get(f"/nodes/{local.nodes[0]}"))["detected_hardware"]["mismatch"] and n,
        15, "the mismatch warning",
    )
    assert here["detected_hardware"]["gpus"] == []
    assert here["detected_hardware"]["mismatch"].startswith("declared 1x RTX 3090 Ti but the agent detected no GPU")
    assert here["measured_samples_per_s"] > 0  # the local agent measured the reference model
    assert (local.tmp / "var" / "hybridtrain.db").exists() and (local.tmp / "var" / "broker.db").exists()


def test_run_on_embedded_defaults_succeeds_once_per_idempotency_key_and_cancels_cleanly(local: Deployment):
    body = {"name": "embedded", "node_ids": local.nodes, "strategy": "ps-bz-gc", "global_batch_size": 48,
            "max_steps": 12, "device": "cpu"}
    first = local.post("/runs", body, headers={"Idempotency-Key": "embedded-1"})
    repeat = local.post("/runs", body, headers={"Idempotency-Key": "embedded-1"})
    assert first.status_code == 201 and repeat.status_code == 200
    run = first.json()
    assert repeat.json()["id"] == run["id"]
    planned = {w["rank"]: w["batch_size"] for w in run["workers"] if w["role"] == "worker"}
    assert sum(planned.values()) == 48 and planned[1] > planned[2] > planned[3]

    done = local.wait_status(run["id"], {"succeeded", "failed", "cancelled"}, timeout=240)
    assert done["status"] == "succeeded", done["reason"]

    def first_batch_sizes() -> dict[int, float]:
        metrics = local.get(f"/runs/{run['id']}/metrics", params={"name": "batch_size"})
        return {s["rank"]: s["points"][0][2] for s in metrics["series"] if s["rank"] in planned}

    # Workers end after their server: their last reports may land just after the run's end.
    wait_until(lambda: len(first_batch_sizes()) == len(planned), 30, "every worker's batch size")
    assert first_batch_sizes() == {r: float(n) for r, n in planned.items()}

    long_run = local.post("/runs", {**body, "name": "embedded-cancel", "max_steps": 100_000}).json()
    running = local.wait_status(long_run["id"], {"running", "failed"}, timeout=120)
    assert running["status"] == "running", running["reason"]
    groups = [w["pid"] for w in running["workers"]]
    assert local.post(f"/runs/{long_run['id']}/cancel").json()["status"] == "cancelling"
    wait_until(lambda: not any(group_alive(g) for g in groups), 30, "every role of the run to be gone")
    # On SQLite too, the run reads cancelled once the agent has reported its roles gone.
    local.wait_status(long_run["id"], {"cancelled"}, timeout=30)
    assert local.get("/runs")["count"] == 2


def test_a_bundled_task_runs_on_the_local_agent_whose_state_dir_is_relative(local: Deployment):
    # `hybridtrain local` starts its agent with --state-dir var/agent: the role runs inside its
    # unpacked bundle, and must still find it (an absolute --code-dir).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDTRAIN_", "CELERY_", "DATABASE_URL"))}
    command = [sys.executable, "-m", "app.cli", "runs", "create", "--server", local.url, "--token", ADMIN,
               "--name", "embedded-bundle", "--nodes", str(local.nodes[0]), "--device", "cpu",
               "--workdir", "examples/diabetes", "--task", "diabetes:task", "--strategy", "allreduce",
               "--max-steps", "10", "--eval-every", "5", "--wait", "--timeout", "150"]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    run = local.get(f"/runs/{json.loads(result.stdout)['id']}")
    assert run["status"] == "succeeded" and run["bundle_sha256"]


def test_stopping_local_stops_its_agent(local: Deployment):
    agent_pid = int(local.local.output().split("agent pid ")[1].split()[0])  # type: ignore[attr-defined]
    assert local.local.stop(signal.SIGTERM) == 0  # type: ignore[attr-defined]
    import psutil

    wait_until(lambda: not psutil.pid_exists(agent_pid) or psutil.Process(agent_pid).status() == psutil.STATUS_ZOMBIE,
               30, "the local agent to stop")
