"""Running a strategy through the control plane's API, as a CI job would: the run's body, its
creation and wait (with progress), and its metrics read back. The paper and fault benchmarks
both run theirs this way (bench/paper/paperbench.py, bench/paper/faults.py)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from hybridtrain import compat
from hybridtrain.contract import (
    ALLREDUCE_POWERSGD,
    COMPRESSING_STRATEGIES,
    EVAL_S,
    LEGACY_TIME_TO_TARGET,
    LOCAL_SGD_STRATEGIES,
    PS_BZ_GC,
    PS_STRATEGIES,
    VAL_LOSS,
)
from hybridtrain.progress import RunProgress, status_text
from testbed import services
from bench.paper.paper_workloads import BenchSettings
from testbed.errors import TestbedError

TERMINAL = ("succeeded", "failed", "cancelled")


def run_body(
    strategy: str, s: BenchSettings, node_ids: list[int], ps_node_id: int | None, tag: str,
    bundle_sha256: str | None = None,
) -> dict[str, Any]:
    """The POST /api/v1/runs body of one strategy."""
    body: dict[str, Any] = {
        "name": f"paper-{strategy}-{tag}-seed{s.seed}",
        "node_ids": node_ids,
        "strategy": strategy,
        "task": s.task,
        "task_args": dict(s.task_args),
        "global_batch_size": s.global_batch,
        "max_steps": s.max_steps,
        "target": s.target,
        "stop_at_target": s.stop_at_target,
        "seed": s.seed,
        "device": "cpu",
    }
    if s.eval_every:
        body["eval_every"] = s.eval_every
    if bundle_sha256:
        body["bundle_sha256"] = bundle_sha256
    return body | strategy_fields(strategy, s, ps_node_id)


def upload_workdir(api: httpx.Client, workdir: Path) -> str:
    """Pack `workdir` as `runs create --workdir` does and upload it (unless the control plane
    has it already); its sha256."""
    from hybridtrain.packing import pack_workdir
    from hybridtrain.contract import BUNDLE_MEDIA_TYPE

    packed = pack_workdir(workdir)
    if api.get(f"/api/v1/bundles/{packed.sha256}").status_code == 404:
        response = api.post("/api/v1/bundles", content=packed.data,
                            headers={"Content-Type": BUNDLE_MEDIA_TYPE, "X-Bundle-Sha256": packed.sha256})
        if response.status_code >= 400:
            raise TestbedError(f"uploading {workdir}: {response.status_code} {response.text[:300]}")
    return packed.sha256


def strategy_fields(strategy: str, s: Any, ps_node_id: int | None) -> dict[str, Any]:
    """The run-body fields one strategy takes from benchmark settings `s` (its server, its
    compression and pipelining, re-balancing, PowerSGD's rank); bench/predict.py shares it."""
    body: dict[str, Any] = {}
    if strategy in PS_STRATEGIES:
        body["ps_node_id"] = ps_node_id
    if strategy in COMPRESSING_STRATEGIES and strategy not in LOCAL_SGD_STRATEGIES and s.compression:
        body["compression"] = dict(s.compression)
    if strategy in LOCAL_SGD_STRATEGIES and getattr(s, "local_sgd", None):
        # Only what this strategy takes (outer_density is diloco-gc's).
        body["local_sgd"] = {k: v for k, v in compat.for_strategy(strategy, s.local_sgd).items() if v is not None}
    if strategy in PS_STRATEGIES and s.pipeline_chunks:
        body["compression"] = body.get("compression", {}) | {"pipeline_chunks": s.pipeline_chunks}
    if strategy == PS_BZ_GC and s.rebalance_every:
        body["rebalance_every"] = s.rebalance_every
    if strategy == ALLREDUCE_POWERSGD and getattr(s, "powersgd_rank", None):
        body["compression"] = {"powersgd_rank": s.powersgd_rank}
    return body


# A run's progress line is printed at most this often (and only when it changed).
PROGRESS_EVERY_S = 15.0


def metrics_reader(api: httpx.Client) -> Callable[..., dict[str, Any]]:
    """GET /runs/{id}/metrics as RunProgress reads it."""

    def fetch(run_id: int, *, rank: int, since: float | None, max_points: int) -> dict[str, Any]:
        params: list[tuple[str, Any]] = [("rank", rank), ("max_points", max_points)]
        if since is not None:
            params.append(("since", since))
        answer = api.get(f"/api/v1/runs/{run_id}/metrics", params=params)
        return services.check_response(answer, f"metrics of {run_id}")

    return fetch


def run_strategy(api: httpx.Client, body: dict[str, Any], timeout_s: float, *, label: str | None = None) -> dict[str, Any]:
    """Create a run, wait for its end (cancelling it past `timeout_s`) showing its progress on
    stdout under `label` (a bar on a terminal), return the run."""
    created = services.check_response(
        api.post("/api/v1/runs", json=body, headers={"Idempotency-Key": body["name"]}),
        f"create run {body['name']}",
    )
    run_id = created["id"]
    deadline = time.monotonic() + timeout_s
    label = label or f"run {run_id} ({body['strategy']})"
    progress = RunProgress(metrics_reader(api), sys.stdout, missed=(httpx.HTTPError, TestbedError),
                           label=f"  {label}", every_s=PROGRESS_EVERY_S)
    status = ""
    try:
        while True:
            run = services.check_response(api.get(f"/api/v1/runs/{run_id}"), f"read run {run_id}")
            if run["status"] in TERMINAL:
                return run
            if run["status"] != status:
                status = run["status"]
                progress.note(f"  {label}: {status_text(run)}")
            if time.monotonic() > deadline:
                progress.note(f"  run {run_id} over its {timeout_s:.0f} s budget: cancelling")
                api.post(f"/api/v1/runs/{run_id}/cancel", json={"reason": "bench time budget"})
                deadline = float("inf")
            progress.poll(run)
            time.sleep(0.5)
    except BaseException:
        # Interrupted: stop the run first, the teardown then removes what is left.
        cancel_quietly(api, run_id, "bench interrupted")
        raise
    finally:
        progress.close()


def cancel_quietly(api: httpx.Client, run_id: int, reason: str) -> None:
    """Ask the control plane to cancel a run on the way out of an interrupted benchmark; a control
    plane that cannot be reached is left to the testbed's teardown."""
    try:
        api.post(f"/api/v1/runs/{run_id}/cancel", json={"reason": reason})
    except httpx.HTTPError:
        pass


# Runs recorded before task metrics name their time to target LEGACY_TIME_TO_TARGET.
METRIC_NAMES = ("loss", "accuracy", VAL_LOSS, "time_to_target_s", LEGACY_TIME_TO_TARGET, EVAL_S,
                "compute_s", "compress_s", "comm_s", "wait_s", "bytes_sent", "batch_size")  # fmt: skip


def rank_nodes(run: dict[str, Any], node_ids: dict[str, int]) -> dict[int, str]:
    """Each rank of `run` (as GET /runs/{id} has it) -> the testbed node it ran on."""
    name_of = {i: n for n, i in node_ids.items()}
    return {w["rank"]: name_of[w["node_id"]] for w in run.get("workers", []) if w.get("node_id") in name_of}


def fetch_metrics(api: httpx.Client, run_id: int, target_metric: str = "accuracy") -> list[dict[str, Any]]:
    """Every stored record of the run that the benchmark reads (and of the target's metric),
    as {rank, peer, name, step, t, value} dicts."""
    names = dict.fromkeys((*METRIC_NAMES, target_metric))
    params: list[tuple[str, str | int]] = [("name", n) for n in names]
    params.append(("max_points", 20_000))
    data = services.check_response(api.get(f"/api/v1/runs/{run_id}/metrics", params=params), f"metrics of {run_id}")
    records = []
    for series in data["series"]:
        if series.get("downsampled"):
            raise TestbedError(f"run {run_id}: series {series['name']} came back downsampled")
        for step, t, value in series["points"]:
            records.append({"rank": series["rank"], "peer": series["peer"], "name": series["name"],
                            "step": step, "t": t, "value": value})  # fmt: skip
    return records
