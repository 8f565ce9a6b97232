"""`hybridtrain bench faults`: one run per fault on the in-box testbed, each fault injected at
a fixed step, and what the run made of it.

1. Bring the testbed up (namespaces, shaping, quotas, control plane, broker, agents).
2. Measure each worker node's standalone speed (the yardstick of "the survivors' ideal"), and
   again right after every run: the host's speed drifts by several percent within minutes
   (338 and 367 samples/s a minute apart on 2026-11-28), so a run is held to the ideal of its
   own moment rather than to one measured before the first run.
3. A fault-free reference run, then one run per fault (`FAULTS`), all `ps-bz-gc` with the same
   task, batch, seed and checkpoint interval. Each fault is injected when the server's step
   counter reaches `fault_step`, and healed where the fault has an end (a link back up, a
   control plane started again).
4. Per run, from the API, the trainers' own metric files and the process table: when the fault
   was detected, whether the run continued or resumed from a checkpoint, steps lost,
   samples/s before and after against the survivors' ideal, final accuracy against the
   reference, metric points lost or doubled, processes left behind.
5. Tear the testbed down, also on failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import psutil

from hybridtrain.contract import EVENT_RESUMED, EVENT_WORKER_JOINED, EVENT_WORKER_LEFT, EVENT_WORKER_LOST, PS_BZ_GC
from testbed import lifecycle, services
from bench.paper.api_runs import TERMINAL, cancel_quietly, fetch_metrics, rank_nodes, run_body
from bench.paper.fault_figures import (
    QUICK,
    FaultSettings,
    Injection,
    check_targets,
    describe_processes,
    get_json,
    leftover_processes,
    logged_points,
    metric_files,
    server_steps,
    stored_points,
    summarise_fault,
    throughput,
    wait_until_none_left,
)
from bench.paper.fault_report import SECTION, markdown
from bench.paper.ideal import measure_calibrated, measure_ideal
from bench.paper.paper_workloads import FULL, BenchSettings
from testbed.errors import TestbedError
from testbed.services import check_response
from testbed.state import TestbedState
from testbed.topology import load_config, plan

Log = Callable[[str], None]


@dataclass
class FaultContext:
    """What an injection needs: the testbed, its API, the run and the node names."""

    state: TestbedState
    state_dir: Path
    api: httpx.Client
    run: dict[str, Any]
    settings: FaultSettings
    nodes: list[str]
    victim: str
    log: Log


# -- the faults ------------------------------------------------------------------------------------


def _role_process(ctx: FaultContext, rank: int) -> psutil.Process:
    """The trainer process of `rank` (the agent reports its guard's pid; the role is below it)."""
    run = get_json(ctx.api, f"/api/v1/runs/{ctx.run['id']}")
    worker = next((w for w in run["workers"] if w["rank"] == rank), None)
    if worker is None or not worker.get("pid"):
        raise TestbedError(f"run {ctx.run['id']}: rank {rank} has no pid yet")
    top = psutil.Process(worker["pid"])
    candidates = [top, *top.children(recursive=True)]
    trainers = [p for p in candidates if _is_trainer(p)]
    if not trainers:
        raise TestbedError(f"run {ctx.run['id']}: no trainer process under pid {worker['pid']}")
    return trainers[-1]


def _is_trainer(proc: psutil.Process) -> bool:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    return "trainer" in cmd and "agents.guard" not in cmd and "testbed.incgroup" not in cmd


def _rank_of(ctx: FaultContext, node: str) -> int:
    node_id = ctx.state.services["node_ids"][node]
    run = get_json(ctx.api, f"/api/v1/runs/{ctx.run['id']}")
    return next(w["rank"] for w in run["workers"] if w["node_id"] == node_id and w["role"] == "worker")


def kill_worker(ctx: FaultContext) -> Injection:
    """kill -9 a worker's trainer (what the kernel's OOM killer does)."""
    proc = _role_process(ctx, _rank_of(ctx, ctx.victim))
    t = time.time()
    proc.send_signal(signal.SIGKILL)
    return Injection(t, ctx.victim, [n for n in ctx.nodes if n != ctx.victim], f"SIGKILL pid {proc.pid}")


def spot_notice(ctx: FaultContext) -> Injection:
    """SIGTERM a worker node's agent, as a cloud's preemption notice does."""
    record = services.service(ctx.state, f"agent-{ctx.victim}")
    t = time.time()
    os.kill(record.pid, signal.SIGTERM)
    return Injection(t, ctx.victim, [n for n in ctx.nodes if n != ctx.victim], f"SIGTERM agent pid {record.pid}")


def cut_link(ctx: FaultContext) -> Injection:
    """Bring a cloud worker's veth down for `link_down_s`, then up again."""
    the_plan = plan(load_config(ctx.state.config_path))
    port, hub = the_plan.endpoint(ctx.victim).hub_port, the_plan.hub_netns
    t = time.time()
    subprocess.run(["ip", "-n", hub, "link", "set", port, "down"], check=True)
    try:
        time.sleep(ctx.settings.link_down_s)
    finally:
        subprocess.run(["ip", "-n", hub, "link", "set", port, "up"], check=True)
    return Injection(t, ctx.victim, [n for n in ctx.nodes if n != ctx.victim],
                     f"{port} down for {ctx.settings.link_down_s:.0f} s")  # fmt: skip


def kill_server(ctx: FaultContext) -> Injection:
    """kill -9 the parameter server's trainer."""
    proc = _role_process(ctx, 0)
    t = time.time()
    proc.send_signal(signal.SIGKILL)
    return Injection(t, None, list(ctx.nodes), f"SIGKILL pid {proc.pid}")


def kill_control_plane(ctx: FaultContext) -> Injection:
    """kill -9 the control plane, keep it dead for `control_plane_down_s`, start it again."""
    record = services.service(ctx.state, "control-plane")
    t = time.time()
    os.killpg(record.pid, signal.SIGKILL)
    time.sleep(ctx.settings.control_plane_down_s)
    services.restart(ctx.state, ctx.state_dir, "control-plane")
    services.wait_healthy(ctx.state)
    return Injection(t, None, list(ctx.nodes), f"down {ctx.settings.control_plane_down_s:.0f} s")


def restart_redis(ctx: FaultContext) -> Injection:
    """Stop the broker (it keeps nothing on disk) and start it again."""
    record = services.service(ctx.state, "redis")
    t = time.time()
    os.killpg(record.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(record.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    services.restart(ctx.state, ctx.state_dir, "redis")
    return Injection(t, None, list(ctx.nodes), "SIGKILL and start again")


def add_worker(ctx: FaultContext) -> Injection:
    """Add the node the run started without (`POST /api/v1/runs/{id}/nodes`)."""
    node_id = ctx.state.services["node_ids"][ctx.victim]
    t = time.time()
    check_response(ctx.api.post(f"/api/v1/runs/{ctx.run['id']}/nodes", json={"node_ids": [node_id]}),
           f"add {ctx.victim} to run {ctx.run['id']}")  # fmt: skip
    return Injection(t, ctx.victim, list(ctx.nodes), "POST /runs/{id}/nodes")


@dataclass(frozen=True)
class Fault:
    """One fault of the benchmark: how to inject it and which event shows it was handled."""

    name: str
    inject: Callable[[FaultContext], Injection]
    detected_by: tuple[str, ...]
    # The run starts without the victim (a join) rather than with it.
    starts_without_victim: bool = False


RESTART_KINDS = ("restart", "restarting")
# After a fault run ends: the agents reap and report what they stopped before it is read back.
SETTLE_S = 10.0
FAULTS = (
    Fault("kill-worker", kill_worker, (EVENT_WORKER_LOST,)),
    Fault("spot-notice", spot_notice, (EVENT_WORKER_LEFT, EVENT_WORKER_LOST)),
    Fault("cut-link", cut_link, (EVENT_WORKER_LOST,)),
    Fault("kill-server", kill_server, (*RESTART_KINDS, EVENT_RESUMED)),
    Fault("kill-control-plane", kill_control_plane, ()),
    Fault("restart-redis", restart_redis, ()),
    Fault("add-worker", add_worker, (EVENT_WORKER_JOINED,), starts_without_victim=True),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)


# -- the benchmark --------------------------------------------------------------------------------


def _bench_settings(s: FaultSettings) -> BenchSettings:
    """The paper benchmark's settings for this workload: its run body and its standalone
    measurement (the survivors' ideal) read the same task, batch and compression."""
    return BenchSettings(task=s.task, task_args=dict(s.task_args), global_batch=s.global_batch,
                         max_steps=s.max_steps, target=s.target, seed=s.seed, eval_every=s.eval_every,
                         stop_at_target=False, compression=dict(FULL.compression), rebalance_every=s.rebalance_every,
                         pipeline_chunks=FULL.pipeline_chunks, standalone_seconds=s.standalone_seconds)  # fmt: skip


def _body(s: FaultSettings, node_ids: list[int], ps_node_id: int | None, name: str) -> dict[str, Any]:
    body = run_body(PS_BZ_GC, _bench_settings(s), node_ids, ps_node_id, name)
    body["name"] = name
    body["checkpoint_every"] = s.checkpoint_every
    if s.aggregate_at_sites:
        body["compression"] = {**body.get("compression", {}), "aggregate_at_sites": True}
    return body


def _wait_step(api: httpx.Client, run_id: int, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = get_json(api, f"/api/v1/runs/{run_id}")
        if run["status"] in TERMINAL:
            raise TestbedError(f"run {run_id} ended ({run['status']}: {run.get('reason')}) before step {step}")
        steps = server_steps(api, run_id)
        if steps and max(s for s, _ in steps) >= step:
            return
        time.sleep(0.5)
    raise TestbedError(f"run {run_id} did not reach step {step} within {timeout_s:.0f} s")


def _wait_end(api: httpx.Client, run_id: int, timeout_s: float, log: Log) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        run = get_json(api, f"/api/v1/runs/{run_id}")
        if run["status"] != last:
            last = run["status"]
            log(f"    run {run_id}: {last}")
        if run["status"] in TERMINAL:
            return run
        time.sleep(1.0)
    api.post(f"/api/v1/runs/{run_id}/cancel", json={"reason": "bench time budget"})
    raise TestbedError(f"run {run_id} did not end within {timeout_s:.0f} s")


def _last_accuracy(api: httpx.Client, run_id: int) -> float | None:
    data = get_json(api, f"/api/v1/runs/{run_id}/metrics", name="accuracy", rank=0, max_points=20_000)
    points = sorted(((s, t, v) for series in data["series"] for s, t, v in series["points"]), key=lambda p: p[1])
    return round(points[-1][2], 4) if points else None


def _share(value: float | None, ideal: float | None) -> str:
    return f"{value / ideal:.3f}" if value and ideal else "n/a"


def run_one(api: httpx.Client, state: TestbedState, state_dir: Path, fault: Fault | None,
            s: FaultSettings, nodes: list[str], victim: str, log: Log) -> tuple[dict[str, Any], Injection | None]:  # fmt: skip
    """One run with `fault` injected at `s.fault_step` (None: the reference run)."""
    ids = state.services["node_ids"]
    config = load_config(state.config_path)
    ps_node_id = ids[config.server.name] if config.server else None
    members = [n for n in nodes if not (fault and fault.starts_without_victim and n == victim)]
    name = f"faults-{fault.name if fault else 'reference'}-{uuid.uuid4().hex[:6]}"
    created = check_response(api.post("/api/v1/runs", json=_body(s, [ids[n] for n in members], ps_node_id, name)),
                     f"create run {name}")  # fmt: skip
    run_id = created["id"]
    injection = None
    try:
        if fault is not None:
            _wait_step(api, run_id, s.fault_step, s.run_timeout_s)
            log(f"    step {s.fault_step}: injecting {fault.name} ({victim})")
            ctx = FaultContext(state, state_dir, api, created, s, nodes, victim, log)
            injection = fault.inject(ctx)
        run = _wait_end(api, run_id, s.run_timeout_s, log)
    except BaseException:
        cancel_quietly(api, run_id, "bench interrupted")
        raise
    return run, injection


def run_bench(args: argparse.Namespace, log: Log = print) -> dict[str, Any]:
    """Everything of `hybridtrain bench faults`; returns the results document."""
    s = replace(QUICK if args.quick else FaultSettings(), aggregate_at_sites=args.aggregate_at_sites)
    faults = [f for f in FAULTS if not args.faults or f.name in args.faults.split(",")]
    unknown = set(args.faults.split(",")) - set(FAULT_NAMES) if args.faults else set()
    if unknown:
        raise TestbedError(f"unknown fault(s) {sorted(unknown)}; choose from {', '.join(FAULT_NAMES)}")
    started = time.monotonic()
    config = load_config(args.config)
    nodes = [n.name for n in config.nodes]
    # The last node is the victim: on the paper testbed, the second cloud V100.
    victim = nodes[-1]
    rows: list[dict[str, Any]] = []
    with lifecycle.signals_raise():
        state = lifecycle.up(args.config, state_dir=args.state_dir, services=True, log=log)
        try:
            with services.admin_client(state) as api:
                ps_node_id = state.services["node_ids"].get(config.server.name) if config.server else None

                plans: dict[int, dict[str, int]] = {}

                def ideal_at(s: FaultSettings) -> dict[str, float]:
                    # Planned once per batch: after a fault its victim's node may be offline (a
                    # spot notice stops its agent), and the plan preview needs every node online.
                    if s.global_batch not in plans:
                        plan_body = _body(s, [state.services["node_ids"][n] for n in nodes], ps_node_id, "faults-plan")
                        preview = check_response(api.post("/api/v1/runs/plan", json=plan_body), "plan preview")
                        plans[s.global_batch] = {w["node_name"]: w["batch_size"] for w in preview["workers"]
                                                 if w["role"] == "worker"}
                    return measure_ideal(state, args.state_dir, plans[s.global_batch], _bench_settings(s), log)

                s, standalone, calibration = measure_calibrated(s, ideal_at, len(nodes), log,
                                                                smallest=FULL.min_global_batch,
                                                                largest=FULL.max_global_batch)  # fmt: skip
                log("  reference run (no fault)")
                ref_run, _ = run_one(api, state, args.state_dir, None, s, nodes, victim, log)
                ref_steps = server_steps(api, ref_run["id"])
                ref_acc = _last_accuracy(api, ref_run["id"])
                ref_tp = throughput(ref_steps, s.global_batch, s.window, max(x for x, _ in ref_steps),
                                    set(range(0, s.max_steps + 1, s.eval_every)))  # fmt: skip
                step_s = s.global_batch / ref_tp if ref_tp else None
                ref_ideal = round(sum(ideal_at(s).values()), 2)
                log(f"  reference: {ref_run['status']}, {ref_tp} samples/s "
                    f"({_share(ref_tp, ref_ideal)} of the ideal measured after it), accuracy {ref_acc}")
                for fault in faults:
                    t0 = time.monotonic()
                    log(f"  {fault.name}")
                    run, injection = run_one(api, state, args.state_dir, fault, s, nodes, victim, log)
                    assert injection is not None
                    time.sleep(SETTLE_S)  # let the agents reap and report what they stopped
                    left, reaped_s = wait_until_none_left(
                        lambda run_id=run["id"]: leftover_processes(state, args.state_dir, run_id), s.reap_timeout_s)
                    events = get_json(api, f"/api/v1/runs/{run['id']}/events")
                    events = events["events"]
                    # The "after" window is the run's last steps: its ideal is measured now.
                    now = ideal_at(s)
                    stored = stored_points(api, run["id"])
                    logged = logged_points(metric_files(state, args.state_dir, run["id"]))
                    lost = sum((logged - stored).values())
                    doubled = sum((stored - logged).values())
                    row = summarise_fault(
                        fault=fault, injection=injection, run=run, events=events,
                        steps=server_steps(api, run["id"]), accuracy=_last_accuracy(api, run["id"]),
                        reference_accuracy=ref_acc, standalone=now, settings=s,
                        lost_or_doubled=(lost, doubled),
                        left_behind=left,
                        records=fetch_metrics(api, run["id"]), rank_node=rank_nodes(run, state.services["node_ids"]),
                    )  # fmt: skip
                    row["standalone"] = now
                    row["reaped_after_s"] = round(SETTLE_S + reaped_s, 1)
                    row["left_behind"] = describe_processes(left)
                    row["misses"] = check_targets(row, step_s)
                    row["wall_s"] = round(time.monotonic() - t0, 1)
                    rows.append(row)
                    log(f"    {row['status']}, detected after {row['detected_after_s']} s, {row['mode']}, "
                        f"{row['steps_lost']} steps lost, after {row['after_of_ideal']} of ideal, "
                        f"lost/doubled {lost}/{doubled}, {row['processes_left']} left, "
                        f"misses: {row['misses'] or 'none'}")  # fmt: skip
                    if fault.name == "spot-notice":
                        services.restart(state, args.state_dir, f"agent-{victim}")
                        services.wait_online(state, [victim])
        finally:
            lifecycle.down(config.name, state_dir=args.state_dir, log=log)
    return {
        "rows": rows,
        "reference": {"run_id": ref_run["id"], "status": ref_run["status"], "samples_per_s": ref_tp,
                      "ideal_samples_per_s": ref_ideal, "final_accuracy": ref_acc,
                      "step_s": round(step_s, 3) if step_s else None},
        "standalone": standalone,
        "calibration": calibration,
        "settings": asdict(s),
        "victim": victim,
        "command": "hybridtrain bench faults " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "faults"] else []),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, write its JSON and (unless --quick) its docs section; 0 when it ran."""
    from bench.paper import report

    try:
        doc = run_bench(args)
    except TestbedError as exc:
        print(f"hybridtrain bench faults: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    section = markdown(doc)
    docs = args.docs if args.docs is not None else (None if args.quick else "docs/BENCHMARKS.md")
    if docs and docs != "-":
        path = Path(docs)
        path.write_text(report.replace_section(path.read_text() if path.exists() else "", section, SECTION))
        print(f"wrote {path}")
    print(section)
    return 0
