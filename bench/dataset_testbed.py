"""A data set run on the namespace testbed: three sites (an on-prem room, two AWS regions), the
data set in an object store in one of them (moto's S3 server in its own namespace), and a site
cache in every site. What it measures goes over real processes and emulated links: the bytes
the store sent to each site (its link's per-site counters), each site cache's counters, what
the workers reported reading, and the run's bill. tests/testbed/test_testbed_datasets.py
checks one such run; `bench/datasets.py --testbed` compares runs with and without the caches.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.paper.api_runs import TERMINAL, upload_workdir
from testbed import services, shaping
from testbed.state import TestbedState
from testbed.topology import load_config, plan

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "bench" / "tasks"
STORE_SITE = "east"
# The data set's store as the control plane prices its reads: the east site's own zone.
STORE = {"store_provider": "aws", "store_continent": "north_america", "store_region": "us-east-1",
         "store_zone": "us-east-1a"}  # fmt: skip
# Two nodes in each remote site, so a shard that crosses a WAN link once serves two readers.
NODES = {"lab": ["lab-a", "lab-b"], "east": ["east-a"], "west": ["west-a", "west-b"]}
DATA_METRICS = ("data_bytes", "data_cache_bytes", "data_samples", "data_sample_digest")


def config(name: str, *, site_caches: bool, wan_mbit: float = 100.0) -> dict[str, Any]:
    """The testbed: on-prem `lab` (the control plane), AWS `east` (the store) and AWS `west`."""
    site = {"kind": "cloud", "provider": "aws", "continent": "north_america", "link_mbit": 1000}
    sites = [
        {"name": "lab", "kind": "onprem", "provider": "onprem", "region": "lab",
         "continent": "north_america", "link_mbit": 1000},
        {"name": "east", "region": "us-east-1", "zone": "us-east-1a", **site},
        {"name": "west", "region": "us-west-2", "zone": "us-west-2a", **site},
    ]  # fmt: skip
    names = [s["name"] for s in sites]
    return {
        "name": name,
        "description": "a data set in an AWS store read from three sites (bench/dataset_testbed.py)",
        # T4s at 0.03 core a TFLOP: 0.24 core a node; the five and the control plane 1.67 cores,
        # the most a 2-core host hands out. A trainer's start (torch's import) is ~2.5 s of CPU.
        "cpu": {"cores_per_tflop": 0.03},
        "sites": sites,
        "wan": [{"between": [a, b], "mbit": wan_mbit} for i, a in enumerate(names) for b in names[i + 1:]],
        "nodes": [{"name": n, "site": s, "gpu": "T4", "instance_type": None if s == "lab" else "g4dn.xlarge"}
                  for s, nodes in NODES.items() for n in nodes],
        # The control plane's start is on the way of every run here, and its speed measures nothing.
        "control_plane": {"site": "lab", "cpu_cores": 0.45},
        "object_store": {"site": STORE_SITE},
        "site_caches": names if site_caches else [],
    }


def write_config(path: Path, name: str, *, site_caches: bool) -> Path:
    """`config(...)` as a YAML file at `path`."""
    import yaml

    path.write_text(yaml.safe_dump(config(name, site_caches=site_caches), sort_keys=False))
    return path


def _cli(*args: str, timeout: float = 120.0) -> str:
    proc = subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"hybridtrain {' '.join(args[:2])} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def make_dataset(folder: Path, samples: int, shard_mb: float) -> Path:
    """The blobs as sample files, sharded by `hybridtrain datasets create`; the shards' folder."""
    sys.path.insert(0, str(TASKS))
    from blob_shards import write_sample_files

    write_sample_files(folder / "samples", samples)
    _cli("datasets", "create", "--from", str(folder / "samples"), "--out", str(folder / "shards"),
         "--shard-mb", str(shard_mb))  # fmt: skip
    return folder / "shards"


def put_and_register(api: httpx.Client, state: TestbedState, shards: Path, name: str) -> dict[str, Any]:
    """Upload the shards into the testbed's store (through its forwarder: no WAN crossed), then
    register them (POST /datasets, as `datasets register` does): the control plane reads the
    index from the store, across its WAN link."""
    client = services.store_client(state)
    client.create_bucket(Bucket="datasets")
    for path in sorted(shards.iterdir()):
        client.upload_file(str(path), "datasets", f"{name}/{path.name}")
    body = {"name": name, "url": f"s3://datasets/{name}", **STORE}
    return services.check_response(api.post("/api/v1/datasets", json=body), f"register data set {name}")


@dataclass(frozen=True)
class RunSettings:
    """The run: two epochs of the data set, evaluated every other step."""

    global_batch: int = 64
    max_steps: int = 12
    target: str = "accuracy>=0.9"
    eval_every: int = 2
    timeout_s: float = 180.0


def run(api: httpx.Client, state: TestbedState, dataset: str, s: RunSettings = RunSettings()) -> dict[str, Any]:
    """An allreduce run of every node on the data set, through the API; the finished run."""
    ids = state.services["node_ids"]
    body = {
        "name": f"data-{dataset}-{time.time_ns()}", "node_ids": [ids[n] for ns in NODES.values() for n in ns],
        "strategy": "allreduce", "task": "blob_shards:task", "task_args": {"name": dataset},
        "bundle_sha256": upload_workdir(api, TASKS), "datasets": [dataset],
        "global_batch_size": s.global_batch, "max_steps": s.max_steps, "target": s.target,
        "stop_at_target": False, "eval_every": s.eval_every, "device": "cpu",
    }  # fmt: skip
    created = services.check_response(api.post("/api/v1/runs", json=body), "create the data set run")
    deadline = time.monotonic() + s.timeout_s
    while True:
        answer = api.get(f"/api/v1/runs/{created['id']}")
        # 503: the control plane's SQLite was busy a moment (a loaded machine); ask again.
        current = services.check_response(answer, "read the run") if answer.status_code != 503 else {"status": ""}
        if current["status"] in TERMINAL:
            return current
        if time.monotonic() > deadline:
            api.post(f"/api/v1/runs/{created['id']}/cancel", json={"reason": "over its time"})
            raise RuntimeError(f"run {created['id']} still {current['status']} after {s.timeout_s:.0f} s")
        time.sleep(0.5)


def records(api: httpx.Client, run_id: int, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The run's stored points of metrics `names`, as {rank, peer, name, step, value}."""
    params: list[tuple[str, str | int]] = [("name", n) for n in names] + [("max_points", 20_000)]
    data = services.check_response(api.get(f"/api/v1/runs/{run_id}/metrics", params=params), "metrics")
    return [{"rank": s["rank"], "peer": s["peer"], "name": s["name"], "step": step, "value": value}
            for s in data["series"] for step, _t, value in s["points"]]


def site_cache_stats(state: TestbedState) -> dict[str, dict[str, Any]]:
    """Each site cache's counters (GET /stats), by site."""
    return {site: httpx.get(f"{c['forwarded_url']}/stats", timeout=10.0, trust_env=False).json()
            for site, c in state.services.get("site_caches", {}).items()}


def store_bytes_by_site(state: TestbedState) -> dict[str, int]:
    """Bytes the store sent to each site (its link's counters)."""
    return shaping.store_bytes_by_site(plan(load_config(state.config_path)))


def site_of_node(state: TestbedState) -> dict[str, str]:
    """Each node's site."""
    return {name: ep["site"] for name, ep in state.endpoints.items() if ep["role"] == "node"}


def bytes_by_site(run: dict[str, Any], points: list[dict[str, Any]], state: TestbedState,
                  metric: str = "data_bytes") -> dict[str, int]:
    """What the workers of each site reported of `metric` over the run."""
    node_of_rank = {w["rank"]: w["node_name"] for w in run["workers"]}
    sites = site_of_node(state)
    out = {site: 0 for site in NODES}
    for p in points:
        if p["name"] == metric:
            out[sites[node_of_rank[p["rank"]]]] += int(p["value"])
    return out
