"""Predicted against measured: the performance model (app/perfmodel/predict.py) on the in-box testbed.

For each testbed (bench/testbeds/paper.yaml, intercontinental.yaml) and each task (the paper
benchmark's widecnn on digits, ResNet-18 on shapes' 32x32 images), in one invocation:

1. bring the testbed up (root: namespaces, tc, cgroups; always torn down, also on failure);
2. probe the links (POST /api/v1/links/probe, then GET /api/v1/links until every pair is
   measured) and profile the task on every node (POST /api/v1/tasks/profiles, until done);
3. read every strategy's prediction from POST /api/v1/runs/plan (the body the run gets, one
   call per strategy, see `plan_body`);
4. run every strategy for real (POST /api/v1/runs, as `hybridtrain bench paper` does) and reduce
   the metrics: rank 0's median samples/s over the steady steps and the bytes per step on links
   that cross sites (the run's bytes_sent records by peer); local SGD's over whole rounds of H
   steps after its first (`steady_rounds`), its bytes the rounds' mean a step;
   Steps 2-4 are repeated (--repeats, 3 by default) and each cell is the median of its runs;
5. print predicted against measured with the error of each cell (goal 10 %, bar 15 %), write the
   JSON (--out) and the "Prediction accuracy" section of docs/BENCHMARKS.md.

Where the control plane does not answer yet (an endpoint 404s, or the plan has no
"prediction"), the harness says so and falls back, each fallback recorded in the JSON:
links from the testbed's own TCP probe (`testbed.probe`), profiles from `trainer.profile` run in
each node's namespace and cgroup, and the prediction from `app.perfmodel.predict.predict` on those.

    sudo .venv/bin/python bench/predict.py --out var/bench/predict.json        # 3 runs a cell, ~2 h
    sudo .venv/bin/python bench/predict.py --quick --out var/bench/predict-quick.json   # < 8 min
    sudo .venv/bin/python bench/predict.py --testbeds paper --tasks resnet18 --strategies ps,ps-gc \
        --repeats 1 --out var/bench/predict-ps.json      # a few cells, ~6 min; a subset writes no docs
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script (bench/*.py are): the checkout's packages come from its root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from hybridtrain.contract import DEFAULT_SYNC_EVERY, LOCAL_SGD_STRATEGIES, PS_STRATEGIES, STRATEGIES  # noqa: E402
from bench.paper.api_runs import cancel_quietly, strategy_fields  # noqa: E402
from bench.paper.paper_workloads import FULL  # noqa: E402
from testbed.services import check_response  # noqa: E402

Log = Callable[[str], None]
SECTION = "## Prediction accuracy (bench/predict.py)"
GOAL_PCT = 10.0
BAR_PCT = 15.0
TESTBEDS = {"paper": "bench/testbeds/paper.yaml", "interc": "bench/testbeds/intercontinental.yaml"}
QUICK_STRATEGIES = ("ps", "ps-bz-gc", "allreduce")
# Variants run beside the strategies: label -> (strategy, options the run body adds). Local SGD
# with sites as replicas: each site's workers one replica, one change per site on the WAN.
VARIANTS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "diloco+replicas": ("diloco", {"local_sgd": {"site_replicas": True}}),
}
# The trainer starts PowerSGD at step 10 (--powersgd-start, not exposed by the API): its runs
# need 10 more steps before the steady state.
POWERSGD_START = 10
# Local SGD's runs: the first round (start-up, the first fetch) is left out and this many whole
# rounds are measured: a round, H inner steps and one outer step, is what repeats.
LOCAL_SGD_ROUNDS = 3
# A plan's max_steps for the steady state: far enough out that the warm-up steps, which the
# measured window leaves out, do not dilute the predicted samples/s.
STEADY_MAX_STEPS = 100_000


@dataclass(frozen=True)
class TaskSettings:
    """One task's workload, the same for every strategy and testbed."""

    key: str
    task: str
    global_batch: int
    max_steps: int
    # Steady state starts after this step (warm-up: dense steps, the first step's start-up).
    skip_steps: int
    task_args: dict[str, Any] = field(default_factory=dict)
    compression: dict[str, Any] = field(default_factory=dict)
    pipeline_chunks: int | None = None
    rebalance_every: int | None = None
    # Local SGD's options (bench.paper.api_runs.strategy_fields): H = 10, as the paper benchmark's
    # widecnn, so that a run of a few rounds takes about a minute.
    local_sgd: dict[str, Any] = field(default_factory=lambda: {"sync_every": 10})
    run_timeout_s: float = 600.0
    profile_seconds: float = 3.0


# The paper benchmark's workload (bench/paper/paper_workloads.py FULL) at a fixed batch: 320 is what its
# calibration chose on this machine (1.5 s of balanced compute on the paper testbed), so a `ps`
# step is ~5 s and a run of 12 steps about a minute after ~35 s of start-up.
# Its task and learning rate are FULL's own, its compression, pipeline and re-split the
# strategies' defaults (FULL leaves them unset); the held-out split is the task's default
# (evaluation is off here, and it does not change a sample's compute).
WIDECNN = TaskSettings(
    key="widecnn",
    task=FULL.task,
    task_args={"lr": FULL.task_args["lr"]},
    global_batch=320,
    max_steps=12,
    skip_steps=3,
)
# ResNet-18 (11.2M parameters, 44.7 MB dense gradient: 3.6 s per direction on the paper's
# 100 Mbit/s WAN) computes 43 samples/s on one full core at 32x32: ~46 samples/s over the paper
# testbed's 1.07 cores, ~55 over the intercontinental's 1.30. A global batch of 64 is ~1.3 s of
# balanced compute, as widecnn's, so the runs stay communication-bound as in the paper; a `ps`
# step is then ~16 s on the paper testbed and 8 steps (5 measured) take about 2.5 minutes.
RESNET18 = TaskSettings(
    key="resnet18",
    task="hybridtrain.tasks.shapes:resnet18",
    task_args={"lr": 0.05},
    global_batch=64,
    max_steps=8,
    skip_steps=2,
)
TASKS = {t.key: t for t in (WIDECNN, RESNET18)}


# ---------------------------------------------------------------------------------------------
# Pure parts (tested in tests/testbed/test_testbed_predict.py).


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """Signed error of a prediction in % of the measurement (+: predicted high); None when
    either is missing or the measurement is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return round(100.0 * (predicted - measured) / measured, 1)


def verdict(err: float | None) -> str:
    """'goal' within 10 %, 'bar' within 15 %, 'off' beyond, '-' without an error."""
    if err is None:
        return "-"
    if abs(err) <= GOAL_PCT:
        return "goal"
    return "bar" if abs(err) <= BAR_PCT else "off"


def strategy_of(label: str) -> str:
    """The strategy a cell's label runs ('diloco' for 'diloco+replicas')."""
    return VARIANTS[label][0] if label in VARIANTS else label


def steps_for(settings: TaskSettings, label: str) -> tuple[int, int]:
    """(max_steps, skip_steps) of one strategy's (or variant's) run: PowerSGD's run waits for its
    start step, local SGD's skips its first round and measures LOCAL_SGD_ROUNDS more."""
    strategy = strategy_of(label)
    if strategy == "allreduce-powersgd":
        return settings.max_steps + POWERSGD_START, settings.skip_steps + POWERSGD_START
    if strategy in LOCAL_SGD_STRATEGIES:
        every = settings.local_sgd.get("sync_every", DEFAULT_SYNC_EVERY)
        return (LOCAL_SGD_ROUNDS + 1) * every, every
    return settings.max_steps, settings.skip_steps


def run_body(label: str, s: TaskSettings, node_ids: list[int], ps_node_id: int | None,
             name: str) -> dict[str, Any]:
    """The POST /api/v1/runs body of one strategy or variant (bench.paper.api_runs's, without a target,
    evaluation off: an evaluation interval is not a training step, and the model times training)."""
    strategy = strategy_of(label)
    max_steps, _ = steps_for(s, label)
    body: dict[str, Any] = {
        "name": name, "node_ids": node_ids, "strategy": strategy, "task": s.task,
        "task_args": dict(s.task_args), "global_batch_size": s.global_batch,
        "max_steps": max_steps, "seed": 0, "device": "cpu", "eval_every": 100_000,
    }  # fmt: skip
    body |= strategy_fields(strategy, s, ps_node_id)
    for section, values in VARIANTS.get(label, ("", {}))[1].items():
        body[section] = (body.get(section) or {}) | values
    return body


def plan_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The plan request for the steady state of `body`'s run: the same body with max_steps far
    out, so the prediction's samples/s is not diluted by the warm-up steps that the measured
    window leaves out."""
    return dict(body) | {"max_steps": STEADY_MAX_STEPS, "name": f"{body['name']}-plan"}


def extract_predictions(response: Any) -> dict[str, dict[str, Any]]:
    """strategy -> prediction dict from a POST /api/v1/runs/plan answer, whichever of the shapes
    it has: one plan with "prediction", a list of plans, or {"plans"|"strategies": [...]}."""
    if isinstance(response, dict) and isinstance(response.get("prediction"), dict):
        pred = response["prediction"]
        return {pred.get("strategy") or response.get("strategy"): pred}
    items: Iterable[Any] = ()
    if isinstance(response, list):
        items = response
    elif isinstance(response, dict):
        for key in ("plans", "strategies", "results", "items"):
            if isinstance(response.get(key), list):
                items = response[key]
                break
            if isinstance(response.get(key), dict):
                items = [v | {"strategy": k} if isinstance(v, dict) else v for k, v in response[key].items()]
                break
    out = {}
    for item in items:
        if not isinstance(item, dict):
            continue
        pred = item.get("prediction")
        if isinstance(pred, dict):
            out[pred.get("strategy") or item.get("strategy") or item.get("plan", {}).get("strategy")] = pred
    return out


def cross_site_bytes(entries: Iterable[Any], site_of: Mapping[Any, str]) -> float:
    """Bytes of (src, dst, bytes) entries whose ends lie in different sites (ends unknown to
    `site_of` are left out)."""
    total = 0.0
    for entry in entries:
        src, dst, nbytes = (entry["src_node_id"], entry["dst_node_id"], entry["bytes"]) if isinstance(entry, dict) else entry
        a, b = site_of.get(src, site_of.get(str(src))), site_of.get(dst, site_of.get(str(dst)))
        if a is not None and b is not None and a != b:
            total += float(nbytes)
    return total


def steady_steps(loss_t: Mapping[int, float], skip_steps: int, eval_steps: set[int]) -> dict[int, float]:
    """step -> seconds since the step before, for steps after `skip_steps` whose previous step
    is recorded and held no evaluation."""
    return {k: loss_t[k] - loss_t[k - 1] for k in sorted(loss_t)
            if k > skip_steps and k - 1 in loss_t and k - 1 not in eval_steps}  # fmt: skip


def steady_rounds(outer_t: Mapping[int, float], skip_steps: int) -> dict[int, tuple[int, float]]:
    """Local SGD: outer step -> (the outer step before it, seconds a step over the round between
    them), for rounds that begin at or after `skip_steps`. Its server records the outer steps
    only, and a round's exchange belongs to its H steps, so the round is what is timed."""
    steps = sorted(outer_t)
    return {b: (a, (outer_t[b] - outer_t[a]) / (b - a)) for a, b in zip(steps, steps[1:]) if a >= skip_steps}


def measure_run(records: list[dict[str, Any]], *, strategy: str, global_batch: int, skip_steps: int,
                rank_site: Mapping[int, str]) -> dict[str, Any]:
    """A run's measured figures from its metric records ({rank, peer, name, step, t, value}):
    median samples/s of rank 0's steady steps, cross-site bytes per steady step, the step
    profile (means over workers and steps) and granularity both ways. Local SGD's steps are
    its rounds' (`steady_rounds`), and its bytes a step the window's mean: they cross the WAN
    at outer steps only, so the median step would carry none."""
    loss_t = {r["step"]: r["t"] for r in records if r["name"] == "loss" and r["rank"] == 0}
    eval_steps = {r["step"] for r in records if r["name"] in ("accuracy", "val_loss")}
    local = strategy in LOCAL_SGD_STRATEGIES
    if local:
        rounds = steady_rounds(loss_t, skip_steps)
        durations = {b: per_step for b, (_, per_step) in rounds.items()}
        window = {k for b, (a, _) in rounds.items() for k in range(a + 1, b + 1)}
    else:
        durations = steady_steps(loss_t, skip_steps, eval_steps)
        window = set(durations)
    step_s = statistics.median(durations.values()) if durations else None
    reduce = statistics.mean if local else statistics.median
    egress: dict[int, float] = {}
    total: dict[int, float] = {}
    for r in records:
        if r["name"] != "bytes_sent" or r["step"] not in window or not r["value"]:
            continue
        total[r["step"]] = total.get(r["step"], 0.0) + float(r["value"])
        src, dst = rank_site.get(r["rank"]), rank_site.get(r["peer"]) if r["peer"] is not None else None
        if src is not None and dst is not None and src != dst:
            egress[r["step"]] = egress.get(r["step"], 0.0) + float(r["value"])
    is_ps = strategy in PS_STRATEGIES
    workers = sorted({r["rank"] for r in records if r["name"] == "compute_s" and not (is_ps and r["rank"] == 0)})

    def mean_of(name: str, ranks: Iterable[int]) -> float | None:
        ranks = set(ranks)
        vals = [float(r["value"]) for r in records
                if r["name"] == name and r["rank"] in ranks and r["step"] in window and r["value"] is not None]
        return round(statistics.mean(vals), 4) if vals else None  # fmt: skip

    profile = {name: mean_of(name, workers) for name in ("compute_s", "compress_s", "comm_s", "wait_s")}
    if is_ps:
        profile |= {f"server_{name}": mean_of(name, [0]) for name in ("compress_s", "comm_s", "wait_s")}
    compute = profile["compute_s"]
    densities = {r: round(statistics.median(float(x["value"]) for x in records if x["name"] == "density"
                                            and x["rank"] == r and x["step"] in window), 5)
                 for r in workers if any(x["name"] == "density" and x["rank"] == r and x["step"] in window
                                         for x in records)}  # fmt: skip
    return {
        "densities": densities,
        "samples_per_s": round(global_batch / step_s, 2) if step_s else None,
        "step_s": round(step_s, 4) if step_s else None,
        "steady_steps": len(window),
        "egress_bytes_per_step": round(reduce(egress.get(k, 0.0) for k in window)) if window else None,
        "bytes_per_step": round(reduce(total.get(k, 0.0) for k in window)) if window else None,
        "profile": profile,
        # The trainer's comm_s is the send only; the step minus compute counts everything else.
        "granularity_trainer": round(compute / profile["comm_s"], 3) if compute and profile["comm_s"] else None,
        "granularity_step": (round(compute / (step_s - compute), 3)
                             if compute and step_s and step_s > compute else None),  # fmt: skip
    }


def window_figures(predicted: Mapping[str, Any], first: int, last: int) -> dict[str, float] | None:
    """The prediction over steps first..last, reduced as `measure_run` reduces a run: samples/s
    at the median step time, the median cross-site bytes per step (from the prediction's
    `phases`: warm-up, the densities' path, the settled state); None without phases covering
    them."""
    phases = predicted.get("phases") or ()
    picked = []
    for k in range(first, last + 1):
        phase = next((p for p in phases if p["first_step"] <= k
                      and (p["last_step"] is None or k <= p["last_step"])), None)  # fmt: skip
        if phase is None:
            return None
        picked.append(phase)
    if not picked or not predicted.get("global_batch"):
        return None
    step_s = statistics.median(p["step_s"] for p in picked)
    return {"samples_per_s": predicted["global_batch"] / step_s, "step_s": step_s,
            "egress_bytes_per_step": statistics.median(p["cross_site_bytes_per_step"] for p in picked)}


def compare(predicted: Mapping[str, Any], measured: Mapping[str, Any], site_of: Mapping[Any, str],
            window: tuple[int, int] | None = None) -> dict[str, Any]:
    """One cell of the table: predicted and measured samples/s and cross-site bytes per step,
    with their errors, the prediction's breakdown beside the measured step profile. With
    `window` (the measured steps), the prediction of those steps where it lists its phases."""
    p_rate = predicted.get("samples_per_s")
    p_egress = cross_site_bytes(predicted.get("bytes_per_step") or (), site_of)
    windowed = window_figures(predicted, *window) if window else None
    if windowed is not None:
        p_rate, p_egress = windowed["samples_per_s"], windowed["egress_bytes_per_step"]
    m_rate, m_egress = measured.get("samples_per_s"), measured.get("egress_bytes_per_step")
    err_rate, err_bytes = error_pct(p_rate, m_rate), error_pct(p_egress, m_egress)
    return {
        "predicted_samples_per_s": round(p_rate, 2) if p_rate is not None else None,
        "measured_samples_per_s": m_rate,
        "error_samples_pct": err_rate,
        "predicted_egress_bytes_per_step": round(p_egress),
        "measured_egress_bytes_per_step": m_egress,
        "error_egress_pct": err_bytes,
        "verdict": max((verdict(err_rate), verdict(err_bytes)), key=["-", "goal", "bar", "off"].index),
        "predicted_step_s": windowed["step_s"] if windowed else predicted.get("step_s"),
        "predicted_over": f"steps {window[0]}-{window[1]}" if windowed else "the settled step",
        "measured_step_s": measured.get("step_s"),
        "predicted_breakdown": predicted.get("breakdown"),
        "measured_profile": measured.get("profile"),
        "predicted_granularity": predicted.get("granularity"),
        "measured_granularity_trainer": measured.get("granularity_trainer"),
        "measured_granularity_step": measured.get("granularity_step"),
    }


def merge_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from repeated runs of it (each its own fresh profile, prediction and run): the
    medians of predicted and measured, the median of the runs' own errors (each pairs a
    prediction with the run it predicted) and its verdict, and every run's figures kept."""
    if len(runs) == 1:
        return runs[0] | {"runs": [_run_summary(runs[0])]}

    def med(values: Iterable[Any], digits: int) -> float | None:
        vals = [v for v in values if v is not None]
        return round(statistics.median(vals), digits) if vals else None

    cell = dict(runs[-1])
    for key, digits in (("predicted_samples_per_s", 2), ("measured_samples_per_s", 2),
                        ("predicted_egress_bytes_per_step", 0), ("measured_egress_bytes_per_step", 0),
                        ("error_samples_pct", 1), ("error_egress_pct", 1), ("predicted_step_s", 4),
                        ("measured_step_s", 4), ("wall_s", 1)):  # fmt: skip
        cell[key] = med((r.get(key) for r in runs), digits)
    cell["verdict"] = max((verdict(cell["error_samples_pct"]), verdict(cell["error_egress_pct"])),
                          key=["-", "goal", "bar", "off"].index)
    probe = [r.get("on_probe_links") or {} for r in runs]
    cell["on_probe_links"] = {"error_samples_pct": med((p.get("error_samples_pct") for p in probe), 1),
                              "error_egress_pct": med((p.get("error_egress_pct") for p in probe), 1)}
    cell["status"] = "succeeded" if all(r.get("status") == "succeeded" for r in runs) else \
        ",".join(str(r.get("status")) for r in runs)
    cell["runs"] = [_run_summary(r) for r in runs]
    return cell


def _run_summary(cell: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("run_id", "status", "predicted_samples_per_s", "measured_samples_per_s", "error_samples_pct",
            "predicted_egress_bytes_per_step", "measured_egress_bytes_per_step", "error_egress_pct",
            "batch_sizes", "densities", "measured_step_s", "measured_profile", "inputs")
    return {k: cell.get(k) for k in keys if k in cell}


def run_errors(cell: Mapping[str, Any]) -> str:
    """The samples/s errors of a cell's runs, in run order ("-": a single run)."""
    runs = cell.get("runs") or ()
    if len(runs) < 2:
        return "-"
    return " ".join(_fmt(r.get("error_samples_pct"), "+.1f") for r in runs)


def _fmt(v: Any, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table_rows(cells: list[dict[str, Any]]) -> list[list[str]]:
    """The printed/Markdown table's rows, one per (testbed, task, strategy)."""
    rows = []
    for c in cells:
        rows.append([c["testbed"], c["task"], c["strategy"], _fmt(c.get("predicted_samples_per_s")),
                     _fmt(c.get("measured_samples_per_s")), _fmt(c.get("error_samples_pct"), "+.1f"),
                     _fmt(_mb(c.get("predicted_egress_bytes_per_step")), ".2f"),
                     _fmt(_mb(c.get("measured_egress_bytes_per_step")), ".2f"),
                     _fmt(c.get("error_egress_pct"), "+.1f"), c.get("verdict", "-"),
                     _fmt((c.get("on_probe_links") or {}).get("error_samples_pct"), "+.1f"),
                     run_errors(c)])  # fmt: skip
    return rows


HEADER = ["testbed", "task", "strategy", "predicted samples/s", "measured samples/s", "error %",
          "predicted egress MB/step", "measured egress MB/step", "error %", "within",
          "samples/s error % on probe links", "each run's samples/s error %"]


def _mb(v: float | None) -> float | None:
    return None if v is None else v / 1e6


def text_table(cells: list[dict[str, Any]]) -> str:
    """The table as aligned text."""
    rows = [HEADER] + table_rows(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows)


def markdown_table(cells: list[dict[str, Any]]) -> str:
    """The table as Markdown."""
    lines = ["| " + " | ".join(HEADER) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * 6 + ["---", "---:", "---"]) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(cells)]
    return "\n".join(lines)


def summary_counts(cells: list[dict[str, Any]]) -> dict[str, int]:
    """How many cells (samples/s and egress counted apart) are within the goal, the bar, off."""
    counts = {"goal": 0, "bar": 0, "off": 0, "-": 0}
    for c in cells:
        for key in ("error_samples_pct", "error_egress_pct"):
            counts[verdict(c.get(key))] += 1
    return counts


def replace_section(text: str, section: str, body: str) -> str:
    """`text` with the Markdown section titled `section` (up to the next "## ") replaced by
    `body`, or `body` appended when there is none."""
    start = text.find(section)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + body.rstrip("\n") + "\n"
    nxt = text.find("\n## ", start + len(section))
    rest = text[nxt + 1:] if nxt >= 0 else ""
    return text[:start] + body.rstrip("\n") + "\n" + ("\n" + rest if rest else "")


class Progress:
    """Progress lines: where the benchmark is and an estimate of the time left."""

    def __init__(self, total_runs: int, log: Log, per_run_s: float = 110.0) -> None:
        self.total, self.done, self.log, self.per_run_s = total_runs, 0, log, per_run_s
        self.t0 = time.monotonic()
        self.setup_s: float | None = None

    def runs_begin(self) -> None:
        """The first run is launched: what came before (the first testbed's start and link
        probes, minutes) is not part of the mean run, else the first estimates read 2-3x long."""
        if self.setup_s is None:
            self.setup_s = time.monotonic() - self.t0

    def left_s(self) -> float:
        """Seconds left: the mean of the runs so far (a guess before the first) times those left."""
        elapsed = time.monotonic() - self.t0 - (self.setup_s or 0.0)
        mean = elapsed / self.done if self.done else self.per_run_s
        return mean * (self.total - self.done)

    def say(self, where: str, what: str) -> None:
        """One line: elapsed, runs done of all, time left, where, what."""
        el = time.monotonic() - self.t0
        self.log(f"[{el / 60:5.1f} min, run {min(self.done + 1, self.total)}/{self.total}, "
                 f"~{self.left_s() / 60:.0f} min left] {where}: {what}")


# ---------------------------------------------------------------------------------------------
# Talking to the testbed's control plane (answers through testbed.services.check_response).


def _items(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, list):
        return data
    for key in ("items", "links", "results", "data"):
        if isinstance(data, dict) and isinstance(data.get(key), list):
            return data[key]
    return []


def probe_links_api(api: httpx.Client, node_ids: list[int], seconds: float, log: Log,
                    pair_timeout_s: float = 45.0) -> dict[tuple[int, int], dict[str, Any]] | None:
    """Probe every link through the control plane (POST /api/v1/links/probe), one pair of
    nodes at a time, waiting until GET /api/v1/links shows both directions measured; None when
    the API has no probe endpoint.

    One pair at a time because probes that run at once share the pipes they measure: with all
    five paper nodes in one request the agents measured the 96 Mbit/s WAN at 6-74 Mbit/s and a
    LAN link at 5.8 (2026-11-24 01:56), and the newest probe of a pair is what the model uses.
    """
    wait_for_quiet_links(api, log)
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    pairs = [(a, b) for i, a in enumerate(node_ids) for b in node_ids[i + 1:]]
    for a, b in pairs:
        asked = time.time()
        resp = api.post("/api/v1/links/probe", json={"node_ids": [a, b], "seconds": seconds})
        if resp.status_code in (404, 405):
            log("  links: POST /api/v1/links/probe not served: falling back to the testbed's probe")
            return None
        check_response(resp, "probe links")
        deadline = time.monotonic() + pair_timeout_s
        while time.monotonic() < deadline:
            for nid in (a, b):
                r = api.get("/api/v1/links", params={"node_id": nid})
                for link in _items(r.json()) if r.status_code < 400 else ():
                    src, dst = link.get("src_node_id"), link.get("dst_node_id")
                    at = link.get("measured_at")
                    if {src, dst} == {a, b} and link.get("mbps") and at and _ts(at) >= asked - 1:
                        seen[(src, dst)] = link
            if (a, b) in seen and (b, a) in seen:
                break
            time.sleep(1.0)
        else:
            log(f"  links: pair {a}-{b} not measured both ways in {pair_timeout_s:.0f} s; going on")
    log(f"  links: {len(seen)} directions measured by the agents, one pair at a time: "
        + ", ".join(f"{a}->{b} {v['mbps']:.0f}" for (a, b), v in sorted(seen.items())))
    return seen


def wait_for_quiet_links(api: httpx.Client, log: Log, quiet_s: float = 15.0, timeout_s: float = 150.0) -> None:
    """Wait until no link report has arrived for `quiet_s`: the probes each agent orders when it
    joins (docs/control-plane.md, "Links") would otherwise share the WAN with the benchmark's."""
    start = time.monotonic()
    last_count, since = -1, time.monotonic()
    while time.monotonic() - start < timeout_s:
        r = api.get("/api/v1/links", params={"limit": 1})
        count = r.json().get("count", 0) if r.status_code < 400 and isinstance(r.json(), dict) else 0
        if count != last_count:
            last_count, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            log(f"  links: the join probes are done ({count} reported) after {time.monotonic() - start:.0f} s")
            return
        time.sleep(1.0)
    log(f"  links: probes still reporting after {timeout_s:.0f} s; going on")


def _ts(value: str) -> float:
    when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


def probe_links_testbed(state: Any, config: Any, log: Log, seconds: float = 1.5) -> dict[tuple[str, str], float]:
    """(src site, dst site) -> Mbit/s measured with the testbed's own probe, one endpoint per
    site; inside a site, its configured link at the 4 % below that TCP measures."""
    from testbed import probe

    first: dict[str, dict[str, Any]] = {}
    for n in config.nodes:
        first.setdefault(state.endpoints[n.name]["site"], state.endpoints[n.name])
    rates = {}
    for a, ea in first.items():
        for b, eb in first.items():
            if a != b:
                rates[(a, b)] = round(probe.measure(ea["netns"], eb["netns"], eb["address"], seconds=seconds), 1)
    for s in config.sites:
        rates[(s.name, s.name)] = round(s.link_mbit * 0.96, 1)
    log(f"  links (testbed probe): {rates}")
    return rates


def profile_api(api: httpx.Client, s: TaskSettings, node_ids: list[int], batch: int, log: Log,
                timeout_s: float = 900.0) -> dict[int, dict[str, Any]]:
    """Profile the task on every node through POST /api/v1/tasks/profiles; node id -> the
    profile (with "result", the trainer's whole JSON, where the control plane stores it).
    The agents repeat each profile until it is stable (2 to 4 runs), hence the long bound."""
    created = check_response(api.post("/api/v1/tasks/profiles", json={
        "task": s.task, "task_args": s.task_args, "node_ids": node_ids, "batch_size": batch, "device": "cpu"}),
        "create profiles")  # fmt: skip
    ids = [p["id"] for p in _items(created)]
    deadline = time.monotonic() + timeout_s
    while True:
        profiles = [check_response(api.get(f"/api/v1/tasks/profiles/{i}"), f"profile {i}") for i in ids]
        states = [p["status"] for p in profiles]
        if all(st in ("done", "failed") for st in states):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"profiles not done after {timeout_s:.0f} s: {states}")
        time.sleep(2.0)
    failed = [p for p in profiles if p["status"] != "done"]
    if failed:
        raise RuntimeError(f"profiles failed: {[(p['node_id'], (p.get('error') or '')[-300:]) for p in failed]}")
    out = {p["node_id"]: p for p in profiles}
    log("  profiles: " + ", ".join(f"{p['node_id']}: {p['samples_per_s']:.1f}/s" for p in profiles))
    return out


def profile_local(state: Any, state_dir: Path, s: TaskSettings, batch: int, names: list[str],
                  log: Log) -> dict[str, dict[str, Any]]:
    """trainer.profile's whole JSON for every endpoint in `names`, run in its namespace and
    cgroup, all at once (the quotas keep them apart)."""
    from testbed import processes

    argv = [sys.executable, "-m", "trainer.profile", "--task", s.task, "--task-args", json.dumps(s.task_args),
            "--batch", str(batch), "--device", "cpu", "--seconds", str(s.profile_seconds), "--threads", "1"]
    records = {n: processes.spawn(state, state_dir, name=f"predict-profile-{n}-{uuid.uuid4().hex[:4]}", argv=argv,
                                  netns_name=state.endpoints[n]["netns"], cgroup=Path(state.endpoints[n]["cgroup"]))
               for n in names}  # fmt: skip
    deadline = time.monotonic() + 300
    while any(processes.is_alive(r) for r in records.values()):
        if time.monotonic() > deadline:
            processes.stop_all(list(records.values()))
            raise RuntimeError("local profiles did not finish in 300 s")
        time.sleep(0.5)
    out = {}
    for n, r in records.items():
        result = last_json(Path(r.log).read_text())
        if result is None:
            raise RuntimeError(f"profile on {n} failed; see {r.log}")
        out[n] = result
    log("  profiles (local): " + ", ".join(f"{n}: {v['samples_per_s']:.1f}/s" for n, v in out.items()))
    return out


def last_json(output: str) -> dict[str, Any] | None:
    """The last JSON object line of a process's output (stderr may follow it)."""
    for line in reversed(output.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def model_prediction(strategy: str, *, profiles: Mapping[str, Mapping[str, Any]], batch_sizes: Mapping[str, int],
                     server: str | None, links: Mapping[tuple[str, str], tuple[float, float]],
                     site_of_name: Mapping[str, str], compression: Mapping[str, Any] | None,
                     eval_every: int | None, max_steps: int | None) -> tuple[dict[str, Any], dict[int, str]]:
    """`app.perfmodel.predict.predict` here, on nodes named as the testbed names them: the workers (in
    rank order) with their batch shares, each node's profile, links (name pair -> (Mbit/s, RTT
    ms)); the prediction as JSON and the site of each node id it uses."""
    from app.perfmodel.predict import LinkSpec, NodeSpec, TaskSpec, predict
    from app.queries.predictions import compression_spec
    from app.schemas.runs import CompressionOptions, LocalSgdOptions

    names = sorted(profiles)
    node_id = {n: i + 1 for i, n in enumerate(names)}
    site_id = {s: i + 1 for i, s in enumerate(sorted(set(site_of_name.values())))}

    def node(n: str) -> Any:
        return NodeSpec.from_profile(node_id[n], n, site_id[site_of_name[n]], profiles[n])

    workers = [(node(n), int(b)) for n, b in batch_sizes.items()]
    specs = {(node_id[a], node_id[b]): LinkSpec(mbps, rtt_ms, "measured")
             for (a, b), (mbps, rtt_ms) in links.items() if a in node_id and b in node_id}  # fmt: skip
    # The body's compression and local_sgd sections as one (as bodies once gave local SGD's knobs).
    given = dict(compression or {})
    local = {k: given.pop(k) for k in LocalSgdOptions.model_fields if k in given}
    comp = compression_spec(strategy, CompressionOptions(**given) if given else None, eval_every=eval_every,
                            local_sgd=LocalSgdOptions(**local) if local else None)
    pred = predict(strategy, workers=workers, server=node(server) if server else None, links=specs,
                   task=TaskSpec.from_profile(profiles[names[0]], with_eval=False), compression=comp, relay=True,
                   max_steps=max_steps)  # fmt: skip
    return pred.to_dict(), {node_id[n]: site_of_name[n] for n in names}


def local_prediction(strategy: str, body: Mapping[str, Any], plan: Mapping[str, Any], *,
                     profiles: Mapping[str, Mapping[str, Any]], site_rates: Mapping[tuple[str, str], float],
                     name_of: Mapping[int, str], site_of_name: Mapping[str, str]) -> dict[str, Any]:
    """The model's prediction computed here (app.perfmodel.predict), from the plan's batch shares, local
    profiles and the testbed probe's rates: the fallback while the API has no "prediction"."""
    names = list(name_of.values())
    links = {(a, b): (site_rates[(site_of_name[a], site_of_name[b])], 0.3) for a in names for b in names if a != b}
    pred, _ = model_prediction(strategy, profiles=profiles, links=links, site_of_name=site_of_name,
                               batch_sizes={name_of[w["node_id"]]: int(w["batch_size"]) for w in plan["workers"]
                                            if w.get("role") == "worker"},
                               server=name_of[body["ps_node_id"]] if body.get("ps_node_id") else None,
                               compression={**(body.get("compression") or {}), **(body.get("local_sgd") or {})},
                               eval_every=body.get("eval_every", 50),
                               max_steps=None)  # fmt: skip
    return pred


def repredict(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` (an earlier --out JSON) with each run's prediction made again by the model as it is
    now, from the inputs the run recorded (its profiles, batch shares and the agents' links),
    against the same measured figures, and its cells merged again: a change of the model
    checked without running again."""
    cells = []
    for cell in doc["cells"]:
        runs = cell.get("runs") or ()
        if len(runs) > 1 and all(r.get("inputs") for r in runs):
            where = {k: cell[k] for k in ("testbed", "task", "strategy")}
            cells.append(merge_repeats([_repredict_run(doc, where | r) for r in runs]))
        else:
            cells.append(_repredict_run(doc, cell))
    return doc | {"cells": cells, "counts": summary_counts(cells)}


def _repredict_run(doc: Mapping[str, Any], cell: dict[str, Any]) -> dict[str, Any]:
    inputs = cell.get("inputs")
    info = doc["testbeds"].get(cell["testbed"], {})
    if not inputs or not info.get("links"):
        return cell | {"prediction_source": "not repredicted (no inputs recorded)"}
    links = {(ln["src"], ln["dst"]): (ln["mbps"], ln["rtt_ms"] or 0.0) for ln in info["links"]}
    pred, site_of = model_prediction(strategy_of(cell["strategy"]), profiles=inputs["profiles"], batch_sizes=inputs["batch_sizes"],
                                     server=inputs["server"], links=links, site_of_name=inputs["sites"],
                                     compression=inputs["compression"], eval_every=inputs["eval_every"],
                                     max_steps=STEADY_MAX_STEPS)  # fmt: skip
    measured = {"samples_per_s": cell["measured_samples_per_s"], "step_s": cell.get("measured_step_s"),
                "egress_bytes_per_step": cell["measured_egress_bytes_per_step"],
                "profile": cell.get("measured_profile")}
    return (cell | compare(pred, measured, site_of, tuple(inputs["window"]))
            | {"prediction_source": "repredicted (app.perfmodel.predict now)", "prediction": pred})


def run_and_wait(api: httpx.Client, body: dict[str, Any], timeout_s: float, progress: Progress,
                 where: str) -> dict[str, Any]:
    """Create the run, show its step of steps until it ends (cancelled past `timeout_s`)."""
    progress.runs_begin()
    created = check_response(api.post("/api/v1/runs", json=body, headers={"Idempotency-Key": body["name"]}),
                     f"create run {body['name']}")
    run_id = created["id"]
    deadline = time.monotonic() + timeout_s
    last = 0.0
    try:
        while True:
            run = check_response(api.get(f"/api/v1/runs/{run_id}"), f"read run {run_id}")
            if run["status"] in ("succeeded", "failed", "cancelled"):
                return run
            if time.monotonic() > deadline:
                progress.say(where, f"run {run_id} over its {timeout_s:.0f} s: cancelling")
                api.post(f"/api/v1/runs/{run_id}/cancel", json={"reason": "bench time budget"})
                deadline = float("inf")
            if time.monotonic() - last > 15:
                last = time.monotonic()
                step = _last_step(api, run_id)
                progress.say(where, f"run {run_id} {run['status']}, step {step} of {body['max_steps']}")
            time.sleep(1.0)
    except BaseException:
        cancel_quietly(api, run_id, "bench interrupted")
        raise


def _last_step(api: httpx.Client, run_id: int) -> int:
    r = api.get(f"/api/v1/runs/{run_id}/metrics", params={"name": "loss", "rank": 0, "max_points": 20_000})
    if r.status_code >= 400:
        return 0
    return max((p[0] for s in r.json().get("series", []) for p in s["points"]), default=0)


# ---------------------------------------------------------------------------------------------
# The whole benchmark.


def bench_testbed(key: str, tasks: list[TaskSettings], strategies: tuple[str, ...], args: argparse.Namespace,
                  progress: Progress, log: Log) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Up, every task and strategy, down (always); the cells and what was learnt of the testbed."""
    from testbed import lifecycle, services
    from testbed.topology import load_config
    from bench.paper.api_runs import fetch_metrics

    config_path = TESTBEDS[key]
    config = load_config(config_path)
    cells: list[dict[str, Any]] = []
    info: dict[str, Any] = {"config": config_path, "fallbacks": []}
    progress.say(key, "bringing the testbed up")
    with lifecycle.signals_raise():
        state = lifecycle.up(config_path, state_dir=args.state_dir, services=True, log=lambda m: None)
        try:
            with services.admin_client(state) as api:
                api.timeout = httpx.Timeout(60.0)
                ids = state.services["node_ids"]
                name_of = {v: k for k, v in ids.items()}
                site_of_name = {n: ep["site"] for n, ep in state.endpoints.items()}
                site_of = {ids[n]: site_of_name[n] for n in ids}
                workers = [ids[n.name] for n in config.nodes]
                server = ids[config.server.name] if config.server else None
                all_ids = workers + ([server] if server else [])
                progress.say(key, f"probing links between {len(all_ids)} nodes")
                api_links = probe_links_api(api, all_ids, 1.5, log)
                # Always: the model is also run on these (one direction at a time, nothing else
                # on the wire), which tells a link-measurement error from a model error.
                site_rates = probe_links_testbed(state, config, log)
                info["site_mbps"] = {f"{a}->{b}": v for (a, b), v in site_rates.items()}
                if api_links is None:
                    info["fallbacks"].append("links: testbed probe")
                else:
                    info["links"] = [{"src": name_of.get(a), "dst": name_of.get(b), "mbps": v.get("mbps"),
                                      "rtt_ms": v.get("rtt_ms")} for (a, b), v in sorted(api_links.items())]
                for s in tasks:
                    cells += bench_task(api, state, args, config, s, strategies, key, progress, log, info,
                                        name_of=name_of, site_of=site_of, site_of_name=site_of_name,
                                        workers=workers, server=server, site_rates=site_rates,
                                        fetch_metrics=fetch_metrics)  # fmt: skip
        finally:
            progress.say(key, "tearing the testbed down")
            lifecycle.down(config.name, state_dir=args.state_dir, log=lambda m: None)
    return cells, info


def bench_task(api: httpx.Client, state: Any, args: argparse.Namespace, config: Any, s: TaskSettings,
               strategies: tuple[str, ...], key: str, progress: Progress, log: Log, info: dict[str, Any], *,
               name_of: dict[int, str], site_of: dict[int, str], site_of_name: dict[str, str],
               workers: list[int], server: int | None, site_rates: dict | None,
               fetch_metrics: Callable) -> list[dict[str, Any]]:
    """One task on an up testbed: profile, predict, run and compare every strategy."""
    where = f"{key} {s.key}"
    ids_of = {v: k for k, v in name_of.items()}
    all_ids = workers + ([server] if server else [])
    share = max(1, s.global_batch // len(workers))
    # Each repeat profiles afresh and predicts from that before it runs: a run is judged against
    # the prediction a user would have had just before launching it, and the host's drift over
    # the invocation (up to 15 % between two runs of one cell here) meets both sides alike.
    runs_of: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        if args.repeats > 1:
            where = f"{key} {s.key} (repeat {rep + 1}/{args.repeats})"
        progress.say(where, f"profiling {s.task} at batch {share} on {len(all_ids)} nodes")
        api_profiles = profile_api(api, s, all_ids, share, log)
        local_profiles = None
        tag = uuid.uuid4().hex[:6]
        for strategy in strategies:
            body = run_body(strategy, s, workers, server, f"predict-{key}-{s.key}-{strategy}-{tag}")
            plan = check_response(api.post("/api/v1/runs/plan", json=plan_body(body)), f"plan {strategy}")
            pred = extract_predictions(plan).get(strategy_of(strategy))
            source = "api"
            if local_profiles is None:
                with_result = {name_of[n]: p["result"] for n, p in api_profiles.items() if isinstance(p.get("result"), dict)
                               and "worker_compress_s" in p["result"]}  # fmt: skip
                local_profiles = (with_result if len(with_result) == len(all_ids)
                                  else profile_local(state, args.state_dir, s, share, [name_of[n] for n in all_ids], log))
                # The control plane's measured speeds, so that the second prediction differs from
                # the API's in its links only (compression costs from the local profile).
                local_profiles = {n: dict(v) | {"samples_per_s": api_profiles[ids_of[n]]["samples_per_s"]}
                                  for n, v in local_profiles.items()}  # fmt: skip
            on_probe = local_prediction(strategy_of(strategy), body, plan, profiles=local_profiles, site_rates=site_rates,
                                        name_of=name_of, site_of_name=site_of_name)  # fmt: skip
            if pred is None:
                source = "local (app.perfmodel.predict)"
                note = f"{s.key}: prediction computed locally (the plan had no 'prediction')"
                if note not in info["fallbacks"]:
                    log(f"  {note}")
                    info["fallbacks"].append(note)
                pred = on_probe
            progress.say(where + f" {strategy}",
                         f"predicted {pred.get('samples_per_s', 0):.1f} samples/s ({source}); running {body['max_steps']} steps")
            t0 = time.monotonic()
            run = run_and_wait(api, body, s.run_timeout_s, progress, where + f" {strategy}")
            # bench.paper.api_runs' reader takes one extra metric name: the densities the workers used.
            records = fetch_metrics(api, run["id"], "density")
            rank_site = {w["rank"]: site_of[w["node_id"]] for w in run["workers"] if w["node_id"] in site_of}
            _, skip = steps_for(s, strategy)
            measured = measure_run(records, strategy=strategy_of(strategy), global_batch=s.global_batch, skip_steps=skip,
                                   rank_site=rank_site)
            cell = {"testbed": key, "task": s.key, "strategy": strategy, "prediction_source": source,
                    "run_id": run["id"], "status": run["status"], "reason": run.get("reason"),
                    "wall_s": round(time.monotonic() - t0, 1),
                    "batch_sizes": {name_of.get(w["node_id"], "?"): w["batch_size"] for w in run["workers"]
                                    if w.get("role") == "worker"}}  # fmt: skip
            # The prediction of the steps measured: past the warm-up, on the densities' path.
            window = (skip + 1, body["max_steps"])
            cell |= compare(pred, measured, site_of, window)
            # The same model on the testbed probe's links (one direction at a time).
            alt = compare(on_probe, measured, site_of, window)
            cell["on_probe_links"] = {k: alt[k] for k in ("predicted_samples_per_s", "error_samples_pct",
                                                          "predicted_egress_bytes_per_step", "error_egress_pct",
                                                          "predicted_breakdown")}  # fmt: skip
            cell["measured_steady_steps"] = measured["steady_steps"]
            if strategy in ("ps-gc", "ps-bz-gc"):
                rank_name = {w["rank"]: name_of.get(w["node_id"]) for w in run["workers"]}
                cell["densities"] = {
                    "predicted": {w.get("name"): w.get("density") for w in pred.get("per_worker") or ()},
                    "measured": {rank_name.get(r): d for r, d in measured["densities"].items()}}
            cell["prediction"] = pred
            # What the prediction was made from, so that a change of the model can be checked
            # against these runs without running them again (`local_prediction`).
            cell["inputs"] = {"profiles": local_profiles,
                              "compression": {**(body.get("compression") or {}), **(body.get("local_sgd") or {})},
                              "eval_every": body.get("eval_every"), "window": list(window),
                              "batch_sizes": {name_of[w["node_id"]]: w["batch_size"] for w in plan["workers"]
                                              if w.get("role") == "worker"},
                              "server": name_of.get(body.get("ps_node_id")),
                              "sites": {name_of[n]: site_of[n] for n in all_ids}}
            cell["measured_bytes_per_step"] = measured["bytes_per_step"]
            cost = api.get(f"/api/v1/runs/{run['id']}/cost")
            if cost.status_code == 200:
                bill = cost.json()
                cell["bill_egress_by_class"] = bill.get("egress_by_class")
                cell["bill_predicted"] = bill.get("predicted") or bill.get("prediction")
            runs_of.setdefault(strategy, []).append(cell)
            progress.done += 1
            progress.say(where + f" {strategy}",
                         f"{run['status']}: measured {_fmt(measured['samples_per_s'])} samples/s vs predicted "
                         f"{_fmt(pred.get('samples_per_s'))} ({_fmt(cell['error_samples_pct'], '+.1f')} %), egress "
                         f"{_fmt(cell['error_egress_pct'], '+.1f')} % [{cell['verdict']}]")
    return [merge_repeats(runs_of[st]) for st in strategies if st in runs_of]


def docs_section(doc: dict[str, Any]) -> str:
    """The "Prediction accuracy" section of docs/BENCHMARKS.md."""
    cells = doc["cells"]
    counts = summary_counts(cells)
    n = sum(v for k, v in counts.items() if k != "-")
    lines = [SECTION, "",
             "The performance model (app/perfmodel/predict.py, docs/predict.md) against real runs on the in-box testbed",
             "(docs/testbed.md): rank 0's median samples/s over the steady steps, and the bytes per step on",
             "links that cross sites, predicted by POST /api/v1/runs/plan against measured (local SGD: over",
             "whole rounds of H steps after the first, the bytes their mean a step). Goal within 10 %,",
             "bar 15 %. \"on probe links\" is the same model (app.perfmodel.predict, the control plane's task profiles)",
             "on the testbed's own TCP probe of each site pair, one direction at a time: where it is close and",
             "the API's prediction is not, the links the agents measured are at fault, not the model.",
             f"Each cell is the median of {doc.get('repeats', 1)} run(s), each profiled and predicted afresh just",
             "before it runs; its error is the median of the runs' own errors, listed in the last column.", "",
             "```sh", doc["command"], "```", "",
             f"{doc['date']}, {doc['machine']['cpus']} cores, {doc['duration_s'] / 60:.1f} minutes; "
             f"cells within 10 %: {counts['goal']} of {n}, within 15 %: {counts['goal'] + counts['bar']} of {n}.", ""]
    fallbacks = sorted({f for info in doc["testbeds"].values() for f in info.get("fallbacks", [])})
    if fallbacks:
        lines += ["Fallbacks used (the control plane did not answer these yet): " + "; ".join(fallbacks) + ".", ""]
    lines += [markdown_table(cells), ""]
    return "\n".join(lines)


def write_doc(doc: dict[str, Any], out: Path, started: float) -> None:
    """Stamp `doc` (date, duration, machine, counts) and write it to `out`, making its folder."""
    doc["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="minutes")
    doc["duration_s"] = round(time.monotonic() - started, 1)
    doc["machine"] = {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()}
    doc["counts"] = summary_counts(doc["cells"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when it ran (whatever the errors), 2 when it could not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="paper testbed, widecnn, ps/ps-bz-gc/allreduce")
    p.add_argument("--testbeds", help="comma-separated of " + ", ".join(TESTBEDS))
    p.add_argument("--tasks", help="comma-separated of " + ", ".join(TASKS))
    p.add_argument("--strategies", help="comma-separated strategies and variants (" + ", ".join(VARIANTS)
                   + "); default all of them")
    p.add_argument("--out", type=Path, default=Path("var/bench/predict.json"))
    p.add_argument("--docs", help="Markdown file to write the section into ('-': none; default "
                   "docs/BENCHMARKS.md for a full run, none for --quick or a subset)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each cell, each with a fresh profile and prediction; the cell is their "
                   "median (default 3, 1 with --quick)")
    p.add_argument("--state-dir", type=Path, default=None)
    p.add_argument("--report", type=Path, help="re-render the table and docs section of an earlier --out JSON; "
                   "runs nothing")
    p.add_argument("--repredict", action="store_true",
                   help="with --report: predict each run again with the model as it is now, from the inputs "
                   "the run recorded")
    args = p.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.report:
        doc = json.loads(args.report.read_text())
        if args.repredict:
            doc = repredict(doc)
        print(text_table(doc["cells"]))
        if args.docs and args.docs != "-":
            path = Path(args.docs)
            path.write_text(replace_section(path.read_text(), SECTION, docs_section(doc)))
            print(f"wrote {path}")
        return 0
    from testbed.errors import TestbedError
    from testbed.state import DEFAULT_STATE_DIR

    args.state_dir = args.state_dir or DEFAULT_STATE_DIR
    testbeds = args.testbeds.split(",") if args.testbeds else (["paper"] if args.quick else list(TESTBEDS))
    tasks = [TASKS[t] for t in (args.tasks.split(",") if args.tasks else (["widecnn"] if args.quick else list(TASKS)))]
    strategies = (tuple(args.strategies.split(",")) if args.strategies
                  else QUICK_STRATEGIES if args.quick else (*STRATEGIES, *VARIANTS))
    if args.quick:
        tasks = [replace(t, max_steps=8, skip_steps=2) for t in tasks]
    started = time.monotonic()
    progress = Progress(len(testbeds) * len(tasks) * len(strategies) * args.repeats, print)
    doc: dict[str, Any] = {"cells": [], "testbeds": {}, "settings": {t.key: asdict(t) for t in tasks},
                           "repeats": args.repeats,
                           "command": "sudo .venv/bin/python bench/predict.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    try:
        for key in testbeds:
            cells, info = bench_testbed(key, tasks, strategies, args, progress, print)
            doc["cells"] += cells
            doc["testbeds"][key] = info
            # After each testbed: a failure or an interrupt later loses nothing already measured.
            write_doc(doc, args.out, started)
    except (TestbedError, RuntimeError) as exc:
        print(f"bench/predict.py: {exc}", file=sys.stderr)
        if not doc["cells"]:
            return 2
    write_doc(doc, args.out, started)
    print(text_table(doc["cells"]))
    print(f"counts: {doc['counts']}; wrote {args.out}")
    subset = args.quick or args.testbeds or args.tasks or args.strategies
    docs = args.docs if args.docs is not None else (None if subset else "docs/BENCHMARKS.md")
    if docs and docs != "-":
        path = Path(docs)
        path.write_text(replace_section(path.read_text(), SECTION, docs_section(doc)))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
