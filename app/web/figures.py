"""The dashboard's charts as Plotly figure dicts, built by small pure functions.

Every function takes plain series (name, rank, peer and `points` of (step, t, value)) and
returns `{"data": [...], "layout": {...}}`, so it is tested without a browser. Traces carry a
`uid` that the live stream (`app.web.live`) names when it appends points, and x is seconds
since the run's start `t0`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Point = tuple[int, float, float | None]
Figure = dict[str, Any]

# A palette that stays readable for up to ten workers on white.
PALETTE = (
    "#2f6fed", "#e4572e", "#17a398", "#f3a712", "#7b5ea7",
    "#db3a7a", "#4c9f38", "#8c6d46", "#3fa7d6", "#6c757d",
)
CLASS_COLORS = {
    "intra_zone": "#9aa5b1",
    "inter_zone": "#3fa7d6",
    "inter_region": "#2f6fed",
    "inter_continent": "#7b5ea7",
    "to_oceania": "#db3a7a",
    "internet": "#e4572e",
}
TOTAL_COLOR = "#1c2433"
# Run events on the timeline and as markers on the charts' time axis.
EVENT_COLORS = {
    "worker_lost": "#c62828",
    "worker_left": "#c77700",
    "worker_joined": "#2e7d32",
    "waiting_for_workers": "#c77700",
    "resumed": "#2f6fed",
    "restarting": "#2f6fed",
}
EVENT_DEFAULT_COLOR = "#6b7585"
# Checkpoints come every N steps: listed in the timeline, not drawn over the charts.
UNMARKED_EVENTS = frozenset({"checkpoint"})


class SeriesLike(Protocol):
    name: str
    rank: int
    peer: int | None
    points: Sequence[Point]


@dataclass(frozen=True)
class Series:
    """One metric series of one rank (and link peer, for byte counts)."""

    name: str
    rank: int
    points: Sequence[Point]
    peer: int | None = None


def color(index: int) -> str:
    """The palette colour of the `index`-th worker."""
    return PALETTE[index % len(PALETTE)]


def worker_label(rank: int) -> str:
    """'worker 1' (ranks are what the trainer and its logs call them)."""
    return f"worker {rank}"


def base_layout(title: str, x_title: str, y_title: str, **extra: Any) -> dict[str, Any]:
    """The layout every chart shares: compact margins, legend below, unified hover."""
    layout: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "margin": {"l": 56, "r": 16, "t": 40, "b": 36},
        "font": {"family": "-apple-system, Segoe UI, Roboto, Helvetica, Arial, sans-serif", "size": 12, "color": "#1c2433"},
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "hovermode": "x unified",
        "legend": {"orientation": "h", "y": -0.14, "x": 0, "yanchor": "top", "font": {"size": 11}},
        # Units on the ticks, not in an axis title that the legend below would collide with.
        "xaxis": {"ticksuffix": x_title, "gridcolor": "#eef1f6", "zeroline": False},
        "yaxis": {"title": {"text": y_title}, "gridcolor": "#eef1f6", "zeroline": False, "rangemode": "tozero"},
    }
    layout.update(extra)
    return layout


def elapsed(points: Iterable[Point], t0: float) -> tuple[list[float], list[float | None], list[int]]:
    """(seconds since t0, values, steps) of `points`, rounded for a compact payload."""
    xs, ys, steps = [], [], []
    for step, t, value in points:
        xs.append(round(t - t0, 3))
        ys.append(None if value is None else float(f"{value:.6g}"))
        steps.append(step)
    return xs, ys, steps


def line(uid: str, name: str, points: Iterable[Point], t0: float, colour: str, **extra: Any) -> dict[str, Any]:
    """A line trace with its step numbers in the hover text."""
    xs, ys, steps = elapsed(points, t0)
    trace = {
        "type": "scatter", "mode": "lines", "uid": uid, "name": name, "x": xs, "y": ys,
        "customdata": steps, "hovertemplate": "%{y:.4g} (step %{customdata})",
        "line": {"color": colour, "width": 1.8},
    }
    trace.update(extra)
    return trace


def by_name(series: Iterable[SeriesLike], name: str, *, skip: Collection[int] = ()) -> list[SeriesLike]:
    """The series of metric `name`, in rank order, leaving out the ranks in `skip`."""
    return sorted(
        (s for s in series if s.name == name and s.rank not in skip), key=lambda s: (s.rank, s.peer or -1)
    )


# A worker whose last point is this many steps behind the newest is gone (it left or was
# lost), not late: it stops counting in the total after its last step.
GONE_AFTER_STEPS = 5


def total_throughput(series: Sequence[SeriesLike]) -> list[Point]:
    """Samples/s of all workers together: at each step, the sum of the latest value of every
    worker in the run at that step (from its first point; until its last, once it is gone).

    A point is emitted only once every such worker has reported, so the total never dips
    because one worker's report is late.
    """
    events: list[tuple[int, float, int, float | None]] = []
    for s in series:
        events.extend((step, t, s.rank, value) for step, t, value in s.points)
    if not events:
        return []
    events.sort(key=lambda e: (e[0], e[1]))
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for step, _, rank, _ in events:
        first.setdefault(rank, step)
        last[rank] = step
    newest = events[-1][0]
    gone = {rank for rank, step in last.items() if step + GONE_AFTER_STEPS < newest}
    latest: dict[int, float] = {}
    total: list[Point] = []
    for step, t, rank, value in events:
        if value is not None:
            latest[rank] = value
        members = [r for r in first if first[r] <= step and not (r in gone and step > last[r])]
        if all(r in latest for r in members):
            point = (step, t, sum(latest[r] for r in members))
            if total and total[-1][0] == step:
                total[-1] = (step, max(t, total[-1][1]), point[2])
            else:
                total.append(point)
    return total


def mean_by_bucket(series: Sequence[SeriesLike], width: int) -> list[Point]:
    """The mean over ranks of each step bucket of `width` steps (a point's step is its bucket's
    last), over the ranks that reported in it: a joiner counts from its first bucket, a leaver
    until its last, and no rank's missing bucket shifts another's."""
    buckets: dict[int, tuple[int, float, list[float]]] = {}
    for s in series:
        for step, t, value in s.points:
            last, latest, values = buckets.get(step // width, (step, t, []))
            if value is not None:
                values.append(value)
            buckets[step // width] = (max(last, step), max(latest, t), values)
    return [(step, t, sum(values) / len(values) if values else None)
            for step, t, values in (buckets[b] for b in sorted(buckets))]


def throughput_figure(series: Sequence[SeriesLike], t0: float, *, servers: Collection[int] = ()) -> Figure:
    """Throughput: samples/s of every worker and of the run in total (a parameter server's
    own figure, rank in `servers`, would count the workers twice and is left out)."""
    workers = by_name(series, "samples_per_s", skip=servers)
    traces = [
        line(f"sps:{s.rank}", worker_label(s.rank), s.points, t0, color(i))
        for i, s in enumerate(workers)
    ]
    traces.insert(0, line("sps:total", "total", total_throughput(workers), t0, TOTAL_COLOR, line={"color": TOTAL_COLOR, "width": 2.6}))
    return {"data": traces, "layout": base_layout("Throughput (samples/s)", " s", "samples/s")}


def loss_figure(series: Sequence[SeriesLike], t0: float, *, servers: Collection[int] = ()) -> Figure:
    """Training loss of every worker (and the server's, if it reports one)."""
    traces = [
        line(f"loss:{s.rank}", loss_label(s.rank, servers), s.points, t0, color(i))
        for i, s in enumerate(by_name(series, "loss"))
    ]
    layout = base_layout("Loss (training)", " s", "loss")
    layout["yaxis"]["type"] = "log" if spans_decades(traces) else "linear"
    return {"data": traces, "layout": layout}


def eval_uid(name: str, rank: int) -> str:
    """The trace of one evaluation metric as one rank reports it."""
    return f"eval:{name}:{rank}"


def eval_color(name: str, names: Sequence[str]) -> str:
    """A metric's colour: its place among the run's evaluation metrics (stable per page)."""
    return color(list(names).index(name) if name in names else len(names))


def evaluation_figure(series: Sequence[SeriesLike], t0: float, names: Sequence[str]) -> Figure:
    """Every evaluation metric the task reported (accuracy, val_loss, r2, ...), one trace per
    metric and reporting rank, with markers at each evaluation."""
    traces = [
        line(eval_uid(s.name, s.rank), s.name, s.points, t0, eval_color(s.name, names),
             mode="lines+markers", marker={"size": 5}, hovertemplate="%{y:.4g} (step %{customdata})")
        for name in names
        for s in by_name(series, name)
    ]
    layout = base_layout("Evaluation", " s", "value")
    # Plotly hides the legend of a single trace, which would leave a lone metric unnamed.
    layout["showlegend"] = True
    if not traces:
        layout["annotations"] = [_no_data("no evaluation yet")]
    return {"data": traces, "layout": layout}


def loss_label(rank: int, servers: Collection[int] = ()) -> str:
    """'loss, worker 2', or 'loss, server' for the parameter server's rank."""
    return "loss, server" if rank in servers else f"loss, {worker_label(rank)}"


def spans_decades(traces: list[dict[str, Any]]) -> bool:
    """Whether the left axis's values span more than two decades (a log axis then reads better)."""
    values = [y for t in traces if t.get("yaxis") != "y2" for y in t["y"] if y is not None and y > 0]
    return bool(values) and max(values) / min(values) > 100


OUTER_COLOR = "#444444"
# Room for a right axis's tick labels and title: base_layout's 16 px cut them off.
RIGHT_AXIS_MARGIN = 64


def outer_norm_trace(points: Iterable[Point], t0: float, rank: int) -> dict[str, Any]:
    """Local SGD's outer steps: the norm of the workers' mean change each applied (right axis)."""
    return line(f"outer_norm:{rank}", "outer step: |mean change|", points, t0, OUTER_COLOR, yaxis="y2",
                mode="lines+markers", marker={"size": 5},
                hovertemplate="outer step %{customdata}: |mean change| %{y:.3g}")


def compression_figure(series: Sequence[SeriesLike], t0: float, *, servers: Collection[int] = (),
                       outer_steps: bool = False) -> Figure:
    """Compression: the density each worker sent (1/density is its compression ratio), and under
    local SGD (`outer_steps`) each outer step's norm of the mean change (every worker logs the same:
    the first's), on a right axis that is there from the start for the live points to join."""
    density = by_name(series, "density", skip=servers)
    traces = [
        line(f"density:{s.rank}", worker_label(s.rank), s.points, t0, color(i),
             hovertemplate="density %{y:.3g} (step %{customdata})")
        for i, s in enumerate(density)
    ]
    norms = by_name(series, "outer_norm", skip=servers)[:1]
    traces += [outer_norm_trace(s.points, t0, s.rank) for s in norms]
    outer_steps = outer_steps or bool(norms)
    title = "Compression: density per worker" + ("; outer steps" if outer_steps else "")
    layout = base_layout(title, " s", "density (sent / dense)")
    layout["yaxis"].update(type="log", rangemode="normal")
    if outer_steps:
        layout["margin"] = layout["margin"] | {"r": RIGHT_AXIS_MARGIN}
        layout["yaxis2"] = {"title": {"text": "|mean change| at an outer step"}, "overlaying": "y", "side": "right",
                            "rangemode": "tozero", "showgrid": False}
    if not traces:
        layout["annotations"] = [_no_data("no compression in this run (dense gradients)")]
    return {"data": traces, "layout": layout}


def staleness_trace(points: Iterable[Point], t0: float, rank: int, colour: str) -> dict[str, Any]:
    """Local SGD's outer steps of one worker: how many inner steps after its send each landed (right axis)."""
    return line(f"staleness:{rank}", f"outer step late, {worker_label(rank)}", points, t0, colour, yaxis="y2",
                mode="markers", marker={"size": 6, "symbol": "diamond"},
                hovertemplate="outer step %{customdata} landed %{y} inner steps late")


# Asynchronous outer steps as the server counts them at each one: legend, hover, colour, symbol.
LATE_CHANGES = {
    "outer_deferred": ("outer step: workers deferred", "workers deferred", "#c77700", "triangle-down"),
    "outer_folded": ("late changes folded", "late changes folded", "#2e7d32", "circle"),
    "outer_dropped": ("late changes dropped", "late changes dropped", "#c62828", "x"),
}
# The batch chart's top band, where those counts are drawn (the batch sizes keep the rest).
LATE_BAND = (0.72, 1.0)


def late_change_hover(name: str) -> str:
    """'outer step 40: 2 late changes folded' for metric `name` of `LATE_CHANGES`."""
    return f"outer step %{{customdata}}: %{{y}} {LATE_CHANGES[name][1]}"


def late_change_trace(name: str, points: Iterable[Point], t0: float, rank: int) -> dict[str, Any]:
    """One of the server's counts per asynchronous outer step, as markers in the batch chart's top band."""
    legend, _, colour, symbol = LATE_CHANGES[name]
    return line(f"{name}:{rank}", legend, points, t0, colour, yaxis="y3", mode="markers",
                marker={"size": 6, "color": colour, "symbol": symbol}, hovertemplate=late_change_hover(name))


def batch_figure(
    series: Sequence[SeriesLike], t0: float, planned: Mapping[int, int] | None = None, *, servers: Collection[int] = (),
    outer_steps: bool = False, late_changes: bool = False,
) -> Figure:
    """Batch size per worker as reported, or the planned constant until a worker reports; under
    local SGD (`outer_steps`) also each worker's outer steps by how many inner steps late they
    landed (the fixed delay, or an asynchronous step's staleness), on a right axis there from the
    start; and under asynchronous outer steps (`late_changes`) the server's counts of the workers
    each round went on without and the late changes it folded or dropped, in a band of their own."""
    reported = by_name(series, "batch_size", skip=servers)
    seen = {s.rank for s in reported}
    traces = [
        line(f"batch:{s.rank}", worker_label(s.rank), s.points, t0, color(i), line={"color": color(i), "width": 1.8, "shape": "hv"})
        for i, s in enumerate(reported)
    ]
    ranks = sorted({*seen, *(planned or {})})
    stale = by_name(series, "outer_staleness", skip=servers)
    traces += [staleness_trace(s.points, t0, s.rank, color(ranks.index(s.rank) if s.rank in ranks else len(ranks)))
               for s in stale]
    # The server alone counts a round's late changes, at its own rank, as the live stream reads them.
    late = [s for name in LATE_CHANGES for s in by_name(series, name) if s.rank in servers]
    traces += [late_change_trace(s.name, s.points, t0, s.rank) for s in late]
    layout = base_layout("Batch size per worker" + ("; outer steps" if outer_steps or stale else ""), " s",
                         "samples per step")
    if outer_steps or stale:
        layout["margin"] = layout["margin"] | {"r": RIGHT_AXIS_MARGIN}
        layout["yaxis2"] = {"title": {"text": "inner steps an outer step landed late"}, "overlaying": "y",
                            "side": "right", "rangemode": "tozero", "showgrid": False, "dtick": 1}
    if late_changes or late:
        # A band of their own rather than a third scale over the batch sizes and the staleness
        # markers: workers and changes are neither samples nor inner steps, and three overlaid
        # scales leave a reader guessing which marker reads on which. Its axis is on the left,
        # where the margin has room for ticks (the right one's are the staleness axis's); it is
        # there from the start, as that axis is, for the live points to join.
        layout["yaxis"]["domain"] = [0.0, LATE_BAND[0] - 0.06]
        layout["yaxis3"] = {"title": {"text": "count"}, "domain": list(LATE_BAND), "anchor": "x", "side": "left",
                            "rangemode": "tozero", "gridcolor": "#eef1f6", "zeroline": False, "nticks": 2}
    for i, (rank, size) in enumerate(sorted((planned or {}).items())):
        if rank not in seen:
            traces.append({"type": "scatter", "mode": "lines", "uid": f"batch:{rank}", "name": f"{worker_label(rank)} (planned)",
                           "x": [0], "y": [size], "customdata": [0], "hovertemplate": "%{y} (planned)",
                           "line": {"color": color(len(reported) + i), "width": 1.8, "shape": "hv", "dash": "dash"}})
    return {"data": traces, "layout": layout}


@dataclass
class EgressSeries:
    """Cumulative egress dollars of one traffic class: (step, t, cumulative usd) points."""

    traffic_class: str
    points: list[Point] = field(default_factory=list)


def egress_figure(classes: Sequence[EgressSeries], t0: float, *, unpriced: Sequence[str] = ()) -> Figure:
    """Egress: cumulative spend by traffic class (the last point is the bill's figure)."""
    traces = [
        line(f"egress:{c.traffic_class}", c.traffic_class.replace("_", " "), c.points, t0,
             CLASS_COLORS.get(c.traffic_class, "#6c757d"),
             hovertemplate="$%{y:.6f} (step %{customdata})",
             line={"color": CLASS_COLORS.get(c.traffic_class, "#6c757d"), "width": 2, "shape": "hv"})
        for c in classes
    ]
    layout = base_layout("Egress spend by traffic class (cumulative)", " s", "USD")
    layout["yaxis"]["tickprefix"] = "$"
    notes = []
    if not traces:
        notes.append(_no_data("no bytes between nodes reported yet"))
    if unpriced:
        notes.append({**_no_data("unpriced: " + "; ".join(unpriced)), "y": 1.0, "yanchor": "top", "font": {"size": 11, "color": "#c77700"}})
    if notes:
        layout["annotations"] = notes
    return {"data": traces, "layout": layout}


def event_color(kind: str) -> str:
    """The colour of a run event of `kind` (membership changes by what they do to the run)."""
    return EVENT_COLORS.get(kind, EVENT_DEFAULT_COLOR)


def event_markers(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Vertical dotted lines at each event's x (seconds since t0), as Plotly layout shapes;
    `events` are `app.web.live.event_view` dicts."""
    return [
        {"type": "line", "xref": "x", "yref": "paper", "x0": e["x"], "x1": e["x"], "y0": 0, "y1": 1,
         "line": {"color": e["color"], "width": 1.2, "dash": "dot"}, "name": f"event:{e['id']}"}
        for e in events
        if e["kind"] not in UNMARKED_EVENTS
    ]


def with_events(figure: Figure, events: Sequence[Mapping[str, Any]]) -> Figure:
    """`figure` with the run's events marked on its time axis."""
    markers = event_markers(events)
    if not markers:
        return figure
    layout = {**figure["layout"], "shapes": [*figure["layout"].get("shapes", []), *markers]}
    return {**figure, "layout": layout}


def _no_data(text: str) -> dict[str, Any]:
    return {"text": text, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False,
            "font": {"size": 13, "color": "#6b7585"}}
