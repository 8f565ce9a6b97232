"""The comparison page's charts (`app.web.routes.compare`): one trace or bar per run, from a
`RunSummary` of each, as Plotly figure dicts like the run page's (`app.web.figures`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.web.figures import Figure, Point, base_layout, color, line, spans_decades


@dataclass(frozen=True)
class RunSummary:
    """What the comparison shows of one run."""

    run_id: int
    label: str
    t0: float
    loss: Sequence[Point]
    throughput: Sequence[Point]
    time_to_target_s: float | None
    egress_usd: float
    compute_usd: float
    target: str | None = None
    samples_per_s: float | None = None
    usd_per_million_samples: float | None = None
    granularity: float | None = None


def compare_loss_figure(runs: Sequence[RunSummary]) -> Figure:
    """Loss against time, one line per run."""
    traces = [line(f"run:{r.run_id}", r.label, r.loss, r.t0, color(i)) for i, r in enumerate(runs)]
    layout = base_layout("Loss against time", " s", "loss (mean over workers)")
    layout["yaxis"]["type"] = "log" if spans_decades(traces) else "linear"
    return {"data": traces, "layout": layout}


def compare_throughput_figure(runs: Sequence[RunSummary]) -> Figure:
    """Throughput (total samples/s) against time, one line per run."""
    traces = [line(f"run:{r.run_id}", r.label, r.throughput, r.t0, color(i)) for i, r in enumerate(runs)]
    return {"data": traces, "layout": base_layout("Throughput (samples/s, all workers)", " s", "samples/s")}


def time_to_target_figure(runs: Sequence[RunSummary]) -> Figure:
    """Time to each run's target, one bar per run (runs that never reached it are marked)."""
    labels = [r.label for r in runs]
    values = [r.time_to_target_s for r in runs]
    text = ["not reached" if v is None else f"{v:.0f} s" for v in values]
    trace = {"type": "bar", "uid": "tta", "x": labels, "y": [v or 0 for v in values], "text": text,
             "textposition": "outside", "marker": {"color": [color(i) for i in range(len(runs))]},
             "hovertemplate": "%{x}: %{text}<extra></extra>"}
    layout = base_layout("Time to target", "", "seconds", hovermode="closest", showlegend=False)
    return {"data": [trace], "layout": layout}


def spend_figure(runs: Sequence[RunSummary]) -> Figure:
    """Spend per run, stacked: compute and egress."""
    labels = [r.label for r in runs]
    traces = [
        {"type": "bar", "uid": "spend:compute", "name": "compute", "x": labels, "y": [round(r.compute_usd, 6) for r in runs],
         "marker": {"color": "#2f6fed"}, "hovertemplate": "compute $%{y:.4f}<extra></extra>"},
        {"type": "bar", "uid": "spend:egress", "name": "egress", "x": labels, "y": [round(r.egress_usd, 6) for r in runs],
         "marker": {"color": "#e4572e"}, "hovertemplate": "egress $%{y:.4f}<extra></extra>"},
    ]
    layout = base_layout("Spend", "", "USD", barmode="stack", hovermode="closest")
    layout["yaxis"]["tickprefix"] = "$"
    return {"data": traces, "layout": layout}
