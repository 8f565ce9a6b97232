"""The whole stack on a testbed: control plane and agents in namespaces, a run over REST."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from testbed import cgroups, lifecycle, netns, services
from testbed.topology import name_prefix

pytestmark = pytest.mark.e2e


def trainer_threads_on_host(endpoint: dict[str, str]) -> bool:
    """Whether a process on the node's quota has threads in the node's host group."""
    on_quota = set(cgroups.pids(Path(endpoint["cgroup"])))
    for tid in cgroups.threads(Path(endpoint["host_cgroup"])):
        try:
            status = Path(f"/proc/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        tgid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Tgid:")))
        if tgid != tid and tgid in on_quota:
            return True
    return False


def test_agents_in_namespaces_run_a_ps_bz_gc_run_through_the_api(
    needs_root: None, write_config: Callable[..., Path], state_dir: Path
) -> None:
    path = write_config(
        server={"name": "lab-ps", "host": "lab-a", "cpu_cores": 0.3},
        control_plane={"site": "lab", "cpu_cores": 0.3},
    )
    name = yaml.safe_load(path.read_text())["name"]
    try:
        state = lifecycle.up(path, state_dir=state_dir, log=lambda _m: None)
        ids = state.services["node_ids"]
        with services.admin_client(state) as api:
            nodes = {n["name"]: n for n in api.get("/api/v1/nodes").json()["data"]}
            assert {n["status"] for n in nodes.values()} == {"online"}
            assert nodes["cloud-a"]["gpus"] == [{"model": "V100 SXM2", "count": 1}]
            assert nodes["lab-a"]["labels"]["netns"] == f"{name_prefix(name)}lab-a"
            # An agent's reference benchmark would time its host group, not the node's quota.
            assert {n["measured_samples_per_s"] for n in nodes.values()} == {None}
            # No task named: the default one (hybridtrain.contract.DEFAULT_TASK) trains.
            run = api.post("/api/v1/runs", json={
                "name": "tiny", "node_ids": [ids["lab-a"], ids["lab-b"], ids["cloud-a"]],
                "ps_node_id": ids["lab-ps"], "strategy": "ps-bz-gc", "global_batch_size": 64,
                "max_steps": 5, "device": "cpu",
            }).json()  # fmt: skip
            deadline = time.monotonic() + 240
            placed = False
            while run["status"] not in ("succeeded", "failed", "cancelled"):
                assert time.monotonic() < deadline, f"run still {run['status']}"
                time.sleep(0.5)
                placed = placed or trainer_threads_on_host(state.endpoints["cloud-a"])
                run = api.get(f"/api/v1/runs/{run['id']}").json()
            assert run["status"] == "succeeded", run.get("reason")
            # The worker computed on its quota and moved its bytes on the host (thread_placer.py).
            assert placed
            # The server ran in its pod, and the batch follows the declared GPUs' FLOPs.
            assert run["master_addr"] == state.endpoints["lab-ps"]["address"]
            sizes = {w["node_name"]: w["batch_size"] for w in run["workers"] if w["role"] == "worker"}
            assert sizes["lab-a"] > sizes["lab-b"] > sizes["cloud-a"]
    finally:
        lifecycle.down(name, state_dir=state_dir, log=lambda _m: None)
    assert netns.list_namespaces(name_prefix(name)) == []
