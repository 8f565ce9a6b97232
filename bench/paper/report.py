"""The paper benchmark's Markdown section and Plotly charts (small pure functions, then I/O).

Only the section under `SECTION` in docs/BENCHMARKS.md is rewritten; the rest of that shared
file is left as it is. Charts are one standalone HTML file (Plotly from its CDN; PNG files
as well when kaleido is installed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridtrain.contract import PS_BZ_GC, STRATEGY_LABELS
from hybridtrain.strategy_defaults import effective
from bench.paper.paper_workloads import numbered_label, split_entry, variant_parts

SECTION = "## Paper benchmark (hybridtrain bench paper)"
CHART_FILE = "paper-bench.html"


# What a variant (bench.paper.paper_workloads.VARIANTS) adds to its strategy's label.
_VARIANT_LABELS = {"plain": "unencrypted", "sites": "per-site aggregation", "fp8": "fp8 values", "fp32": "fp32 values",
                   "inforward": "apply-in-forward", "quotaio": "threads on the quota",
                   "async": "asynchronous outer steps",
                   "streaming": "streaming fragments"}


def strategy_label(entry: str) -> str:
    """A table's name for a `--strategies` entry: `ps-bz-gc+sites` -> `PS-bz-gc + per-site
    aggregation`, `diloco-gc+h100+density5` -> `DiLoCo-gc, H = 100, density 5 %`."""
    strategy, variant = split_entry(entry)
    label = STRATEGY_LABELS.get(strategy, strategy)
    for part in variant_parts(variant):
        label += numbered_label(part) or f" + {_VARIANT_LABELS.get(part, part)}"
    return label


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "n/a"
    return format(value, spec) if spec else str(value)


def _with_spread(r: dict[str, Any], key: str, spec: str) -> str:
    """A figure, as 'mean ± sd' where it is a mean over several seeds."""
    spread = (r.get("spread") or {}).get(key)
    if r.get("seeds") and len(r["seeds"]) > 1 and spread and r.get(key) is not None:
        return f"{format(r[key], spec)} ± {format(spread['sd'], spec)}"
    return _fmt(r.get(key), spec)


def parts_of(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The (testbed, workload) parts of a results document; one written before workloads is
    its own single part."""
    return doc["parts"] if "parts" in doc else [doc]


def part_title(part: dict[str, Any]) -> str:
    """'widecnn on paper': the part's workload and testbed; a sweep's part with its WAN
    bandwidth: 'widecnn on paper, WAN at 10 Mbit/s'."""
    name = part.get("workload") or workload(part["settings"])[0]
    if part.get("wan_mbit") is not None:
        return f"{name} on {part['base_testbed']}, WAN at {part['wan_mbit']:g} Mbit/s"
    return f"{name} on {part['testbed']['name']}"


# ---------------------------------------------------------------------------------------------
# The bandwidth sweep (--wan-mbit): a workload on a testbed at several WAN bandwidths.


def sweep_groups(doc: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(workload, testbed) -> its sweep parts by rising bandwidth; empty without a sweep."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for part in parts_of(doc):
        if part.get("wan_mbit") is not None:
            key = (part.get("workload") or workload(part["settings"])[0], part["base_testbed"])
            groups.setdefault(key, []).append(part)
    return {k: sorted(v, key=lambda p: p["wan_mbit"]) for k, v in groups.items()}


def share_of_ideal(part: dict[str, Any], strategy: str) -> float | None:
    """A strategy's throughput over its part's ideal (None where either is unknown)."""
    rate, ideal = (part["results"].get(strategy) or {}).get("samples_per_s"), part.get("ideal_samples_per_s")
    return round(rate / ideal, 3) if rate and ideal else None


def _sweep_strategies(parts: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(s for part in parts for s in part["results"]))


def sweep_table(parts: list[dict[str, Any]]) -> str:
    """One row per strategy; for each bandwidth its share of the ideal and time to target."""
    cols = [f"{p['wan_mbit']:g} Mbit/s" for p in parts]
    lines = ["| strategy | " + " | ".join(f"share of ideal, {c} | time to target (s), {c}" for c in cols) + " |",
             "| --- |" + " ---: | ---: |" * len(parts)]
    for strategy in _sweep_strategies(parts):
        cells = " | ".join(f"{_fmt(share_of_ideal(p, strategy), '.3f')} "
                           f"| {_fmt((p['results'].get(strategy) or {}).get('tta_s'), '.1f')}" for p in parts)
        lines.append(f"| {strategy_label(strategy)} | {cells} |")
    return "\n".join(lines)


def sweep_winners(parts: list[dict[str, Any]]) -> str:
    """Which strategy wins at each bandwidth: the highest share of the ideal, the fastest to target."""
    said = []
    for p in parts:
        strategies = _sweep_strategies([p])
        shares = {s: v for s in strategies if (v := share_of_ideal(p, s)) is not None}
        ttas = {s: v for s in strategies if (v := (p["results"].get(s) or {}).get("tta_s")) is not None}
        share, tta = "unknown", "none reached the target"
        if shares:
            best = max(shares, key=lambda s: shares[s])
            share = f"{strategy_label(best)} ({shares[best]:.3f})"
        if ttas:
            best = min(ttas, key=lambda s: ttas[s])
            tta = f"{strategy_label(best)} ({ttas[best]:.1f} s)"
        said.append(f"at {p['wan_mbit']:g} Mbit/s, highest share of the ideal {share}, fastest to target {tta}")
    return "Best: " + "; ".join(said) + "."


def _seeds_text(doc: dict[str, Any]) -> str:
    seeds = next((r.get("seeds") for r in doc["results"].values() if r.get("seeds")), None) or [doc["settings"]["seed"]]
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {', '.join(map(str, seeds))} (figures are means ± sample standard deviation over them)"


def markdown_table(doc: dict[str, Any]) -> str:
    """The results table, one row per strategy, with throughput relative to ps-bz-gc."""
    results = doc["results"]
    bz = results.get(PS_BZ_GC, {}).get("samples_per_s")
    lines = [
        ("| strategy | samples/s | ps-bz-gc is x faster | time to target (s) | final accuracy "
         "| MB/step (all ranks) | granularity | egress (USD) | steps | status |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for strategy, r in results.items():
        sps = r.get("samples_per_s")
        speedup = f"{bz / sps:.2f}" if bz and sps else "n/a"
        mb = r["bytes_per_step"] / 1e6 if r.get("bytes_per_step") is not None else None
        lines.append(
            f"| {strategy_label(strategy)} | {_with_spread(r, 'samples_per_s', '.1f')} | {speedup} "
            f"| {_with_spread(r, 'tta_s', '.1f')} | {_with_spread(r, 'final_accuracy', '.4f')} "
            f"| {_fmt(mb, '.2f')} | {_with_spread(r, 'granularity', '.2f')} "
            f"| {_fmt(r.get('egress_usd'), '.4f')} | {r.get('steps')} | {r.get('status')} |"
        )
    ideal = doc.get("ideal_samples_per_s")
    when = " after the ps-bz-gc runs" if doc.get("ideal_at_start_samples_per_s") not in (None, ideal) else ""
    lines.append(f"| ideal (sum of standalone workers{when}) | {_fmt(ideal, '.1f')} | | | | | | | | |")
    return "\n".join(lines)


def targets_table(doc: dict[str, Any]) -> str:
    """The issue's targets: measured value, goal, met or missed."""
    lines = ["| target | measured | goal | met |", "| --- | ---: | ---: | --- |"]
    for name, t in doc.get("targets", {}).items():
        lines.append(f"| {name} | {_fmt(t['value'])} | {t['goal']} | {'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines)


def profile_table(doc: dict[str, Any]) -> str:
    """Where a step's time goes, per strategy (means over the steady state, seconds)."""
    cols = ["slowest_worker_compute_s", "worker_compress_s", "worker_comm_s", "worker_wait_s",
            "server_wait_s", "server_compress_s", "server_comm_s"]  # fmt: skip
    head = "| strategy | step (s) | " + " | ".join(c.removesuffix("_s").replace("_", " ") for c in cols) + " |"
    lines = [head, "| --- |" + " ---: |" * (len(cols) + 1)]
    for strategy, r in doc["results"].items():
        prof = r.get("profile", {})
        cells = " | ".join(_fmt(prof.get(c), ".3f") for c in cols)
        lines.append(f"| {strategy_label(strategy)} | {_fmt(r.get('step_s'), '.3f')} | {cells} |")
    return "\n".join(lines)


def figures(doc: dict[str, Any]) -> list[Any]:
    """Time-to-target bars, throughput bars (with the ideal), loss against training time."""
    import plotly.graph_objects as go

    out = []
    for part in parts_of(doc):
        out += _part_figures(part, go)
    for (name, base), parts in sweep_groups(doc).items():
        out.append(sweep_figure(name, base, parts, go))
    return out


def sweep_figure(name: str, base: str, parts: list[dict[str, Any]], go: Any) -> Any:
    """Share of the ideal (left) and time to target (right) against the WAN's bandwidth, both
    on a log bandwidth axis, one line per strategy."""
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    # A strategy keeps one colour in both panels (Plotly's default colorway, set per trace).
    colours = qualitative.Plotly
    fig = make_subplots(rows=1, cols=2, subplot_titles=("share of the ideal (higher is better)",
                                                         "time to target, s (lower is better)"))  # fmt: skip
    x = [p["wan_mbit"] for p in parts]
    for i, strategy in enumerate(_sweep_strategies(parts)):
        label, colour = strategy_label(strategy), colours[i % len(colours)]
        tta = [(p["results"].get(strategy) or {}).get("tta_s") for p in parts]
        for col, y in ((1, [share_of_ideal(p, strategy) for p in parts]), (2, tta)):
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=label, legendgroup=label,
                                     showlegend=col == 1, line={"color": colour}), row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="WAN bandwidth (Mbit/s)", type="log")
    fig.update_yaxes(title_text="share of the ideal", row=1, col=1)
    fig.update_yaxes(title_text="seconds", row=1, col=2)
    fig.update_layout(title=f"{name} on {base} against the WAN's bandwidth", width=1100, height=450)
    return fig


def _part_figures(doc: dict[str, Any], go: Any) -> list[Any]:
    results = doc["results"]
    where = part_title(doc)
    names = [strategy_label(s) for s in results]
    tta = go.Figure(go.Bar(x=names, y=[r.get("tta_s") for r in results.values()]))
    tta.update_layout(title=f"{where}: time to {workload(doc['settings'])[2]} (s, evaluations left out, "
                      "lower is better)", yaxis_title="seconds")
    thr = go.Figure(go.Bar(x=names, y=[r.get("samples_per_s") for r in results.values()]))
    if doc.get("ideal_samples_per_s"):
        thr.add_hline(y=doc["ideal_samples_per_s"], line_dash="dash", annotation_text="ideal")
    thr.update_layout(title=f"{where}: training throughput (samples/s, higher is better)", yaxis_title="samples/s")
    loss = go.Figure()
    for strategy, r in results.items():
        curve = r.get("loss_curve") or []
        if curve:
            t0 = curve[0][0]
            loss.add_trace(go.Scatter(x=[t - t0 for t, _ in curve], y=[v for _, v in curve],
                                      mode="lines", name=strategy_label(strategy)))  # fmt: skip
    loss.update_layout(title=f"{where}: training loss against time", xaxis_title="seconds since the first step",
                       yaxis_title="loss", yaxis_type="log")  # fmt: skip
    return [tta, thr, loss]


def workload(settings: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """(task, task args, target) of a results document's settings, also of one written before
    tasks existed (model, dataset, lr, target_accuracy)."""
    if "task" in settings:
        return settings["task"], settings.get("task_args") or {}, settings.get("target") or "none"
    task = f"hybridtrain.tasks.{settings.get('dataset')}:{settings.get('model')}"
    args = {"lr": settings["lr"]} if "lr" in settings else {}
    target = settings.get("target_accuracy")
    return task, args, "none" if target is None else f"accuracy>={target}"


def section(doc: dict[str, Any], chart_links: list[str]) -> str:
    """The whole Markdown section (heading included): one subsection per part."""
    load = doc.get("machine", {}).get("load_avg_at_end")
    lines = [
        SECTION,
        "",
        (f"Measured {doc.get('date', '')} on this {doc.get('machine', {}).get('cpus')}-CPU "
         f"machine (1-minute load average at the end {load[0]:.1f}), in "
         f"{doc.get('duration_s', 0) / 60:.1f} minutes. Reproduce (root): `{doc.get('command')}`."),
        "",
        "Charts: " + ", ".join(f"[{Path(c).name}]({c})" for c in chart_links) + ". "
        "What each profile says about each target, and by how much a missed one is missed: "
        "docs/testbed.md, \"Where the step goes\".",
        "",
    ]
    for part in parts_of(doc):
        lines += part_section(part)
    for (name, base), parts in sweep_groups(doc).items():
        lines += [
            f"### Bandwidth sweep: {name} on {base}",
            "",
            (f"Every WAN link of `{base}` at each bandwidth in turn (the subsections above); share of "
             "the ideal against each part's own ideal, time to target as above."),
            "",
            sweep_table(parts),
            "",
            sweep_winners(parts),
            "",
        ]
    return "\n".join(lines)


def exchange_text(s: dict[str, Any]) -> str:
    """ps-bz-gc's pipeline, compression and re-split as a part's settings ran them: those the
    workload set, the strategy's defaults (hybridtrain.strategy_defaults) for the rest."""
    compression = dict(s.get("compression") or {})
    if s.get("pipeline_chunks"):
        compression["pipeline_chunks"] = s["pipeline_chunks"]
    ran = effective(PS_BZ_GC, {"compression": compression, "rebalance_every": s.get("rebalance_every")})
    return f"`{json.dumps(ran['compression'], sort_keys=True)}`, re-split every {ran['rebalance_every']} steps"


def part_section(doc: dict[str, Any]) -> list[str]:
    """One (testbed, workload) part's subsection: what ran, results, targets, step profile."""
    s = doc["settings"]
    task, task_args, target = workload(s)
    tb = doc["testbed"]
    return [
        f"### {part_title(doc)}",
        "",
        (f"Testbed `{tb['name']}` ({tb['description']}); see docs/testbed.md. Workload: task "
         f"`{task}` with args `{json.dumps(task_args)}`, global batch {s['global_batch']}, "
         f"{_seeds_text(doc)}, at most {s['max_steps']} steps, evaluation every "
         f"{s.get('eval_every') or 'trainer default'} steps, target `{target}`; ps-bz-gc's exchange "
         f"{exchange_text(s)}. Throughput is the steady state after "
         f"{s['skip_steps']} steps; time to target is the trainer's own (training time, "
         "start-up excluded) less the evaluations before it, which throughput leaves out too."),
        "",
        markdown_table(doc),
        "",
        "Targets of issue 18, from this one invocation (on the means):",
        "",
        targets_table(doc),
        "",
        ("Where a step's time goes (seconds, means over the steady state; worker columns are "
         "means over the workers, `wait` is the time from a worker's send to the server's reply):"),
        "",
        profile_table(doc),
        "",
    ]


def replace_section(document: str, new_section: str, heading: str = SECTION) -> str:
    """`document` with its section under `heading` (up to the next `## ` heading) replaced,
    or appended."""
    lines = document.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        sep = "" if document.endswith("\n") or not document else "\n"
        return document + sep + ("\n" if document else "") + new_section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + new_section + ("\n" if tail else "") + tail


def write_charts(doc: dict[str, Any], chart_dir: Path) -> list[Path]:
    """The run's charts in `chart_dir`: one HTML file, and a PNG a chart where kaleido is
    installed (it draws with the system's chromium); the paths written, the HTML file first."""
    figs = figures(doc)
    chart_dir.mkdir(parents=True, exist_ok=True)
    html = chart_dir / CHART_FILE
    html.write_text(
        "<html><head><meta charset='utf-8'><title>hybridtrain bench paper</title></head><body>"
        + "".join(
            f.to_html(full_html=False, include_plotlyjs="cdn" if i == 0 else False)
            for i, f in enumerate(figs)
        )
        + "</body></html>"
    )
    written = [html]
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return written  # kaleido is not installed here: the HTML file is the chart
    import plotly.io as pio

    names = [f"{part.get('workload', 'bench')}-{part['testbed']['name']}-{kind}"
             for part in parts_of(doc) for kind in ("tta", "throughput", "loss")]
    names += [f"sweep-{name}-{base}" for name, base in sweep_groups(doc)]
    pngs = [chart_dir / f"paper-{name}.png" for name in names]
    # One browser session for all of them: write_image would start chromium once a chart.
    if len(figs) != len(pngs):  # a chart would land under another's name
        raise RuntimeError(f"{len(figs)} charts for {len(pngs)} file names")
    pio.write_images(figs, pngs)
    return written + pngs


def write_docs(doc: dict[str, Any], docs_path: Path) -> list[Path]:
    """Write the charts next to `docs_path` (in bench/) and rewrite its section; the paths written."""
    written = write_charts(doc, docs_path.parent / "bench")
    links = [f"bench/{p.name}" for p in written]
    old = docs_path.read_text() if docs_path.exists() else "# Benchmarks\n"
    docs_path.write_text(replace_section(old, section(doc, links)))
    return [*written, docs_path]
