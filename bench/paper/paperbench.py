"""`hybridtrain bench paper`: seed 000's comparison, through the product, in one command.

For each testbed of `--config` (the paper's and the intercontinental one by default), and on
it each workload (bench/paper/paper_workloads.py: widecnn and ResNet-18 on digits):
1. Bring the testbed up (namespaces, shaping, quotas, control plane, agents).
2. Measure the ideal: every worker's compute alone, in its own namespace and cgroup, on the
   batch `ps-bz-gc` gives it (the plan preview); the sum is the ideal. It is measured again
   right after each `ps-bz-gc` run, and the share of the ideal is read against the mean of
   those (`ideal_samples_per_s`; the first is `ideal_at_start_samples_per_s`): the host's
   speed drifts by several percent within minutes.
3. Run the five strategies through the REST API (`POST /api/v1/runs`), with the same task (a
   built-in `hybridtrain.tasks.<dataset>:<model>` and its args), global batch, steps and
   target, seed by seed: every strategy of a seed one after another, then the next seed, so
   that the host's drift falls on all of them alike.
4. Read each run's metrics and bill back from the API and reduce them (bench/paper/paper_figures.py:
   `summarise`, `combine_seeds` over the seeds), check the issue's targets, write results.json,
   the Markdown section of docs/BENCHMARKS.md and the charts.
5. Tear the testbed down, also on failure, Ctrl-C or SIGTERM.

With `--wan-mbit 10,100,1000` each testbed is brought up once per bandwidth, every WAN link at
that bandwidth (`paper` becomes `paperw10`, ...), each its own part; bench/paper/report.py
sets them side by side (share of the ideal and time to target against the bandwidth).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from hybridtrain.contract import PS_BZ_GC, STRATEGIES, parse_target
from hybridtrain.progress import duration
from testbed import lifecycle, services, thread_placer
from bench.paper.api_runs import fetch_metrics, rank_nodes, run_body, run_strategy, upload_workdir
from bench.paper.ideal import Log, measure_calibrated, measure_ideal
from bench.paper.paper_figures import check_targets, combine_seeds, ideal_of_the_runs, link_prices, summarise
from bench.paper.paper_workloads import (
    BenchSettings,
    configs_of,
    seeds_of,
    strategy_variant,
    variant_body,
    variant_parts,
    workdir_of,
    workloads_of,
)
from testbed.errors import TestbedError
from testbed.state import TestbedState
from testbed.topology import TestbedConfig, load_config

SECTION = "## Paper benchmark (hybridtrain bench paper)"


# ---------------------------------------------------------------------------------------------
# Variants.


def check_strategies(strategies: tuple[str, ...], configs: list[TestbedConfig]) -> None:
    """Refuse, before any testbed is built, a strategy or variant the invocation cannot run."""
    for entry in strategies:
        strategy, variant = strategy_variant(entry)
        if strategy not in STRATEGIES:
            raise TestbedError(f"--strategies: unknown strategy {strategy!r} (one of {', '.join(STRATEGIES)}, "
                               "each optionally +plain or +quotaio, a PS one +sites or +inforward, a "
                               "compressing one +fp8, a local SGD or compressing one +fp32)")
        without = [c.name for c in configs if not c.cpu.threads_on_host]
        if "quotaio" in variant_parts(variant) and without:
            raise TestbedError(f"--strategies: {entry!r}: testbed {', '.join(without)} runs without the thread "
                               "placer (cpu.threads_on_host: false): its threads are on the quotas already")


def placer_pause_file(state: TestbedState, variant: str) -> Path | None:
    """The file that pauses the thread placer for `variant`'s run (None: leave it running)."""
    return Path(state.services["threads_on_quota_file"]) if "quotaio" in variant_parts(variant) else None


# ---------------------------------------------------------------------------------------------
# The bandwidth sweep (--wan-mbit): each testbed again with every WAN link at one bandwidth.

# Under the state dir, never in the checkout; a name with a dash is no testbed's (`up` clears
# the folder named after the testbed it builds).
SWEEP_DIR = "wan-sweep"


def mbit_text(mbit: float) -> str:
    """A bandwidth as the sweep writes it: `10`, `2.5` (no exponent: cli.py refuses those)."""
    return f"{mbit:g}"


def at_bandwidth(config: TestbedConfig, mbit: float) -> TestbedConfig:
    """`config` with every WAN link at `mbit`, a name of its own (`paper` -> `paperw10`, cut to
    the 10 characters a testbed's name may have) and a description saying so; the rest as it was."""
    suffix = "w" + mbit_text(mbit).replace(".", "p")
    raw = config.model_dump()
    raw["name"] = config.name[: 10 - len(suffix)] + suffix
    raw["wan"] = [{**link, "mbit": mbit} for link in raw["wan"]]
    # The description names the WAN as written (`100 Mbit/s WAN`): say it was overridden.
    said = f"every WAN link at {mbit_text(mbit)} Mbit/s (--wan-mbit)"
    raw["description"] = f"{config.description}; {said}" if config.description else said
    # Validated again: a name or bandwidth the config refuses is refused here, not at `up`.
    return TestbedConfig.model_validate(raw)


@dataclass(frozen=True)
class Testbed:
    """One testbed the invocation brings up: its config file, the config, the testbed of
    `--config` it comes from, and the bandwidth its WAN links were set to (None: as written)."""

    __test__ = False

    path: str
    config: TestbedConfig
    base: str
    wan_mbit: float | None = None


def sweep_testbeds(paths: list[str], configs: list[TestbedConfig], mbits: tuple[float, ...] | None,
                   out_dir: Path) -> list[Testbed]:
    """The testbeds to bring up in turn: the configs as they are without a sweep; with one,
    each config at each bandwidth, its derived config written into `out_dir`."""
    if not mbits:
        return [Testbed(p, c, c.name) for p, c in zip(paths, configs)]
    beds = [Testbed(str(out_dir / f"{d.name}.yaml"), d, c.name, mbit)
            for c in configs for mbit in mbits for d in [at_bandwidth(c, mbit)]]  # fmt: skip
    names = [b.config.name for b in beds]
    if len(set(names)) < len(names):
        raise TestbedError(f"--wan-mbit: the testbeds {', '.join(c.name for c in configs)} give the same "
                           f"derived names ({', '.join(names)}); sweep them one --config at a time")
    out_dir.mkdir(parents=True, exist_ok=True)
    for b in beds:
        Path(b.path).write_text(yaml.safe_dump(b.config.model_dump(mode="json"), sort_keys=False))
    return beds


# ---------------------------------------------------------------------------------------------
# The whole benchmark.


@dataclass
class Tally:
    """Runs done and to do over the whole invocation, for the time-left estimate."""

    total: int
    walls: list[float] = field(default_factory=list)

    def left_text(self) -> str | None:
        """'about N min of runs left', from the mean of the runs so far (None before the first)."""
        if not self.walls:
            return None
        return f"about {duration(statistics.mean(self.walls) * (self.total - len(self.walls)))} of runs left"


def run_bench(args: argparse.Namespace, log: Log = print,
              save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Everything of `hybridtrain bench paper`; returns the results document: one part per
    (testbed, workload), each with its own ideal, results and targets. `save` gets the
    document so far after each part, so a failure later loses none of the parts done."""
    workloads = workloads_of(args)
    paths = configs_of(args)
    configs = [load_config(p) for p in paths]
    strategies = tuple(args.strategies.split(",")) if args.strategies else STRATEGIES
    check_strategies(strategies, configs)
    mbits = getattr(args, "wan_mbit", None)
    beds = sweep_testbeds(paths, configs, mbits, args.state_dir / SWEEP_DIR)
    started = time.monotonic()
    command = "hybridtrain " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else (
        f"hybridtrain bench paper --config {','.join(paths)}{' --quick' if args.quick else ''}"
        f"{' --wan-mbit ' + ','.join(map(mbit_text, mbits)) if mbits else ''} --out {args.out}")
    tally = Tally(total=len(beds) * sum(len(strategies) * s.seeds for _, s in workloads))
    log(f"bench paper: {'quick' if args.quick else 'full'} run of {', '.join(strategies)}, workloads "
        f"{', '.join(n for n, _ in workloads)}, on {', '.join(b.config.name for b in beds)}: {tally.total} runs")
    parts: list[dict[str, Any]] = []

    def document() -> dict[str, Any]:
        return {
            "parts": parts,
            "command": command,
            "duration_s": round(time.monotonic() - started, 1),
            "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }

    with lifecycle.signals_raise():
        for bed in beds:
            config = bed.config
            state = lifecycle.up(bed.path, state_dir=args.state_dir, services=True, log=log)
            try:
                with services.admin_client(state) as api:
                    for name, settings in workloads:
                        log(f"bench paper: workload {name} on {config.name}")
                        part = _bench_on(api, state, args.state_dir, config, settings, strategies, log,
                                         tally=tally, where=f"{name} on {config.name}", targets_for=bed.base)
                        sweep = {"base_testbed": bed.base, "wan_mbit": bed.wan_mbit} if bed.wan_mbit else {}
                        parts.append({"workload": name, **part, **sweep})
                        if save is not None:
                            save(document())
            finally:
                lifecycle.down(config.name, state_dir=args.state_dir, log=log)
    return document()


def _bench_on(
    api: httpx.Client,
    state: TestbedState,
    state_dir: Path,
    config: TestbedConfig,
    s: BenchSettings,
    strategies: tuple[str, ...],
    log: Log,
    *,
    tally: Tally | None = None,
    where: str = "",
    targets_for: str | None = None,
) -> dict[str, Any]:
    ids = state.services["node_ids"]
    worker_names = [n.name for n in config.nodes]
    node_ids = [ids[n] for n in worker_names]
    ps_node_id = ids[config.server.name] if config.server else None
    name_of = {v: k for k, v in ids.items()}
    tag = uuid.uuid4().hex[:6]
    bundle = upload_workdir(api, workdir_of(s)) if s.workdir else None

    def ideal_at(s: BenchSettings) -> dict[str, float]:
        plan = services.check_response(
            api.post("/api/v1/runs/plan", json=run_body(PS_BZ_GC, s, node_ids, ps_node_id, tag, bundle)),
            "plan preview")
        batch_by_node = {w["node_name"]: w["batch_size"] for w in plan["workers"] if w["role"] == "worker"}
        log(f"  ps-bz-gc plan at global batch {s.global_batch}: {batch_by_node}")
        return measure_ideal(state, state_dir, batch_by_node, s, log)

    s, standalone, calibration = measure_calibrated(s, ideal_at, len(node_ids), log, smallest=s.min_global_batch,
                                                    largest=s.max_global_batch)  # fmt: skip
    ideal = round(sum(standalone.values()), 2)
    target_metric = parse_target(s.target).metric

    tally = tally or Tally(total=len(strategies) * s.seeds)
    per_seed: dict[str, list[dict[str, Any]]] = {entry: [] for entry in strategies}
    # Seeds outside, strategies inside: each seed's strategies run back to back, so the host's
    # drift over the invocation (several percent within minutes, docs/testbed.md) falls on every
    # strategy alike instead of on whichever ran last.
    for seed in seeds_of(s):
        for number, entry in enumerate(strategies, 1):
            strategy, variant = strategy_variant(entry)
            t0 = time.monotonic()
            label = f"{where + ' ' if where else ''}[{number}/{len(strategies)}] {entry}, seed {seed}"
            left = tally.left_text()
            if left:
                log(f"  {label}: {left}, this one included")
            body = variant_body(run_body(strategy, replace(s, seed=seed), node_ids, ps_node_id, tag, bundle),
                                variant)
            with thread_placer.paused(placer_pause_file(state, variant)):
                run = run_strategy(api, body, s.run_timeout_s, label=label)
            records = fetch_metrics(api, run["id"], target_metric)
            rank_node = rank_nodes(run, ids)
            cost = api.get(f"/api/v1/runs/{run['id']}/cost")
            bill = cost.json() if cost.status_code == 200 else None
            summary = summarise(records, strategy=strategy, global_batch=s.global_batch,
                                skip_steps=s.skip_steps, rank_node=rank_node,
                                egress_usd_per_gb=link_prices(bill) if bill else None,
                                site_of={n: ep["site"] for n, ep in state.endpoints.items()})  # fmt: skip
            if bill:
                # The control plane's own bill is the figure; ours (the benchmark's per-link
                # byte counts at the bill's per-link rates) stays beside it as a cross-check.
                summary["egress_usd_check"] = summary["egress_usd"]
                summary["egress_usd"] = bill["egress_usd"]
                summary["cost"] = {k: bill.get(k) for k in ("total_usd", "compute_usd",
                                   "usd_per_million_samples", "egress_by_class", "unpriced")}  # fmt: skip
            summary |= {"seed": seed, "run_id": run["id"], "status": run["status"], "reason": run.get("reason"),
                        "wall_s": round(time.monotonic() - t0, 1),
                        "batch_sizes": {name_of.get(w["node_id"], "?"): w["batch_size"]
                                        for w in run["workers"] if w["role"] == "worker"}}  # fmt: skip
            if entry == PS_BZ_GC:
                # The share of the ideal is read against the ideal of the run's own moment: the
                # host's speed drifts by several percent within minutes (docs/testbed.md).
                summary["ideal_after_samples_per_s"] = round(sum(ideal_at(s).values()), 2)
            tally.walls.append(summary["wall_s"])
            per_seed[entry].append(summary)
            log(f"  {label}: {run['status']}, {summary['samples_per_s']} samples/s, "
                f"tta {summary['tta_s']} s, accuracy {summary['final_accuracy']}, "
                f"{summary['steps']} steps, {summary['wall_s']} s")  # fmt: skip
    results = {entry: combine_seeds(runs) for entry, runs in per_seed.items()}
    share_ideal = ideal_of_the_runs(results, ideal)
    # A sweep's testbed (`paperw10`) is held to the targets of the one it comes from (`paper`).
    targets = check_targets(results, share_ideal, testbed=targets_for or config.name)
    return {
        "results": results,
        # What the share of the ideal is read against: the mean of the ideals measured right
        # after each ps-bz-gc run (the first measurement where ps-bz-gc did not run).
        "ideal_samples_per_s": share_ideal,
        "ideal_at_start_samples_per_s": ideal,
        "ideal_per_node": standalone,
        "calibration": calibration,
        "targets": targets,
        "settings": asdict(s),
        "testbed": _describe_testbed(config, state),
    }


def _describe_testbed(config: TestbedConfig, state: TestbedState) -> dict[str, Any]:
    return {
        "name": config.name,
        "config": state.config_path,
        "description": config.description,
        "cores_per_tflop": config.cpu.cores_per_tflop,
        "sites": {s.name: {"kind": s.kind, "provider": s.provider, "link_mbit": s.link_mbit} for s in config.sites},
        "wan_mbit": {"-".join(w.between): w.mbit for w in config.wan},
        "endpoints": {name: {k: ep[k] for k in ("role", "site", "gpu", "cpu_cores", "address")}
                      for name, ep in state.endpoints.items()},
    }  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run the benchmark and write results.json, docs and charts; 0 when it ran (targets aside)."""
    from bench.paper import report

    def save(doc: dict[str, Any]) -> None:
        write_results(doc, args.out)

    try:
        doc = run_bench(args, save=save)
    except TestbedError as exc:
        kept = f" (the parts done are in {args.out})" if args.out.exists() else ""
        print(f"hybridtrain bench paper: {exc}{kept}", file=sys.stderr)
        return 2
    save(doc)
    print(f"wrote {args.out}")
    # A quick run is a smoke test: it leaves the recorded full results in the docs alone.
    docs = args.docs if args.docs is not None else (None if args.quick else "docs/BENCHMARKS.md")
    if docs and docs != "-":
        written = report.write_docs(doc, Path(docs))
        print("wrote " + ", ".join(str(p) for p in written))
    if args.charts:
        print("wrote " + ", ".join(str(p) for p in report.write_charts(doc, args.charts)))
    for part in report.parts_of(doc):
        print(f"\n{report.part_title(part)}\n{report.markdown_table(part)}")
    for (name, base), parts in report.sweep_groups(doc).items():
        print(f"\nBandwidth sweep: {name} on {base}\n{report.sweep_table(parts)}\n\n{report.sweep_winners(parts)}")
    return 0


def write_results(doc: dict[str, Any], out: Path) -> None:
    """results.json at `out`, its folder made first (a fresh checkout has no var/bench): a
    missing folder after the first part must not lose the parts done."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_public(doc), indent=2) + "\n")


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    # The curves are for the charts; results.json keeps the figures (and accuracy per eval).
    out = json.loads(json.dumps(doc))
    for part in out["parts"]:
        for result in part["results"].values():
            result.pop("loss_curve", None)
    return out
