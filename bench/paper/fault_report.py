"""The fault benchmark's section of docs/BENCHMARKS.md: the command, the reference run, one row
per fault and, for the faults with an "after" window, where its step went. The figures
themselves are bench/paper/fault_figures.py's."""

from __future__ import annotations

from typing import Any

SECTION = "## Fault benchmark (hybridtrain bench faults)"


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _calibrated(calibration: dict[str, Any] | None) -> str:
    if not calibration:
        return ""
    return (f" (calibrated for {calibration['balanced_step_s']} s of balanced compute from "
            f"{calibration['probe_ideal_samples_per_s']} samples/s at batch {calibration['probe_batch']})")


def _steps(span: list[int] | None) -> str:
    return f"{span[0]}-{span[1]}" if span else "n/a"


def _of_ideal(ref: dict[str, Any]) -> str:
    tp, ideal = ref.get("samples_per_s"), ref.get("ideal_samples_per_s")
    return f" ({tp / ideal:.3f} of the {_fmt(ideal)} ideal measured after it)" if tp and ideal else ""


def markdown(doc: dict[str, Any]) -> str:
    """The docs section: the command, the reference, one row per fault."""
    ref = doc["reference"]
    lines = [
        SECTION, "",
        f"`{doc['command'].strip()}` on {doc['date']} ({doc['machine']['cpus']} CPUs, "
        f"{doc['duration_s'] / 60:.0f} min). Every run is `ps-bz-gc` on the paper testbed"
        f"{' with per-site aggregation (`--aggregate-at-sites`)' if doc['settings'].get('aggregate_at_sites') else ''}, "
        f"the fault injected at step {doc['settings']['fault_step']} of {doc['settings']['max_steps']} "
        f"on `{doc['victim']}` where it hits a node; global batch {doc['settings']['global_batch']}"
        f"{_calibrated(doc.get('calibration'))}; checkpoints every "
        f"{doc['settings']['checkpoint_every']} steps. \"after\" is measured over the last "
        f"{doc['settings']['window']} steps with the nodes then training, or, where a lost node "
        "joins again, over the survivors' steps before it does (the last steps, with it, only "
        "where it came back too soon for that). The survivors' ideal "
        "is the sum of their standalone speeds measured right after the run (the host's speed "
        "drifts by several percent within minutes). Reference run (no fault): "
        f"{_fmt(ref['samples_per_s'])} samples/s{_of_ideal(ref)}, final accuracy {_fmt(ref['final_accuracy'])}.",
        "",
        "| fault | status | detected after (s) | continued or resumed | steps lost | samples/s before | "
        "after | after: steps | after / survivors' ideal | accuracy vs reference (points) | "
        "points lost / doubled | processes left | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in doc["rows"]:
        lines.append(
            f"| {r['fault']} | {r['status']} | {_fmt(r['detected_after_s'])} | {r['mode']} | {r['steps_lost']} | "
            f"{_fmt(r['samples_per_s_before'])} | {_fmt(r['samples_per_s_after'])} | {_steps(r.get('after_steps'))} | "
            f"{_fmt(r['after_of_ideal'])} | "
            f"{_fmt(r['accuracy_delta_points'])} | {r['metric_points_lost']} / {r['metric_points_doubled']} | "
            f"{r['processes_left']} | {'met' if not r['misses'] else '; '.join(r['misses'])} |"
        )  # fmt: skip
    profiled = [r for r in doc["rows"] if r.get("after_profile")]
    if profiled:
        lines += [
            "",
            "Where a step of the \"after\" window goes, against the survivors' ideal step (the global "
            "batch at the sum of their standalone rates). The share of the ideal is the product of "
            "*compute* (the ideal step over the slowest survivor's compute: the split and each node's "
            "speed against its standalone one) and *overhead* (that compute over the whole step: "
            "compression, communication and the server's update left exposed). Means over the window, "
            "seconds:",
            "",
            "| fault | step | ideal step | slowest compute | compute share | overhead | overhead share | "
            "worker compress | worker comm | worker wait | server compress | survivors' speed vs standalone |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]  # fmt: skip
        for r in profiled:
            p = r["after_profile"]
            speeds = ", ".join(f"{n} {_fmt(v['rate_vs_standalone'])}" for n, v in sorted(p["nodes"].items()))
            lines.append(
                f"| {r['fault']} | {_fmt(p['step_s'])} | {_fmt(p['ideal_step_s'])} | {_fmt(p['slowest_compute_s'])} | "
                f"{_fmt(p['compute_share'])} | {_fmt(p['overhead_s'])} | {_fmt(p['overhead_share'])} | "
                f"{_fmt(p['worker_compress_s'])} | {_fmt(p['worker_comm_s'])} | {_fmt(p['worker_wait_s'])} | "
                f"{_fmt(p['server_compress_s'])} | {speeds} |"
            )  # fmt: skip
    return "\n".join(lines) + "\n"
