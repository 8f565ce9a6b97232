"""What the run page's live stream sends: new metric rows turned into points to append to the
charts' traces, new run events for its timeline, and a cursor that reads new rows without
missing any.

Both are plain objects with no database or network, so the stream's logic is tested alone;
`app.web.routes.runs` feeds them rows.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Protocol

from app.billing import egress_usd, round_usd
from app.web.figures import (
    CLASS_COLORS,
    LATE_CHANGES,
    OUTER_COLOR,
    TOTAL_COLOR,
    color,
    eval_color,
    eval_uid,
    event_color,
    late_change_hover,
    loss_label,
    worker_label,
)
from hybridtrain.contract import LEGACY_TIME_TO_TARGET, SYSTEM_METRICS


@dataclass(frozen=True)
class MetricRow:
    """One stored metric row (`peer` -1 when none, as stored)."""

    id: int
    name: str
    rank: int
    peer: int
    step: int
    t: float
    value: float | None


class IdCursor:
    """Reads rows by increasing id without losing those whose transactions commit late.

    Ids are handed out when a row is inserted, not when its transaction commits, so a poll for
    `id > last` can pass over a row that becomes visible after a higher id did. The cursor
    therefore re-reads every id above `floor`, remembers which of them it has already passed
    on, and raises `floor` past an id only once it has been seen for `settle_s` seconds, by
    which time any transaction holding a lower id has committed or gone.
    """

    def __init__(self, after_id: int, *, settle_s: float = 2.0) -> None:
        self.floor = after_id
        self.settle_s = settle_s
        self._seen: dict[int, float] = {}

    def fresh(self, ids_and_rows: Iterable[tuple[int, Any]], now: float) -> list[Any]:
        """The rows (read with `id > self.floor`) not passed on before; then advances the floor."""
        out = []
        for row_id, row in ids_and_rows:
            if row_id <= self.floor or row_id in self._seen:
                continue
            self._seen[row_id] = now
            out.append(row)
        settled = [row_id for row_id, seen_at in self._seen.items() if now - seen_at >= self.settle_s]
        if settled:
            # Everything at or below the highest settled id is final; forget it.
            self.floor = max(self.floor, max(settled))
            self._seen = {i: s for i, s in self._seen.items() if i > self.floor}
        return out


@dataclass(frozen=True)
class LinkRate:
    """How bytes from one rank to another are billed: their traffic class and the sender's $/GB."""

    traffic_class: str
    usd_per_gb: Decimal


# Which chart and trace a metric name feeds.
_CHART_OF = {
    "samples_per_s": ("throughput", "sps"),
    "loss": ("loss", "loss"),
    "density": ("compression", "density"),
    "batch_size": ("batch", "batch"),
}


def is_evaluation_metric(name: str) -> bool:
    """Whether `name` is one of a task's evaluation metrics rather than a system metric."""
    return name not in SYSTEM_METRICS and name != LEGACY_TIME_TO_TARGET


@dataclass
class LiveState:
    """Turns new metric rows into trace appends, carrying what spans batches: each worker's
    latest samples/s (for the total) and the exact cumulative egress dollars per class."""

    t0: float
    worker_ranks: Sequence[int]
    server_ranks: Collection[int] = ()
    link_rates: Mapping[tuple[int, int], LinkRate] = field(default_factory=dict)
    egress_usd_by_class: dict[str, Decimal] = field(default_factory=dict)
    latest_sps: dict[int, float] = field(default_factory=dict)
    last_total_step: int = -1
    # The task's evaluation metrics in chart order; a name first seen live is appended.
    eval_names: list[str] = field(default_factory=list)

    def apply(self, rows: Iterable[MetricRow]) -> list[dict[str, Any]]:
        """Appends for the charts: `{chart, uid, name, color, x, y, customdata}` per trace, and
        how a trace the chart lacks is drawn (`yaxis`, `mode`, `symbol`, `hovertemplate`) where it
        differs from a line."""
        appends: dict[str, dict[str, Any]] = {}

        def add(chart: str, uid: str, name: str, colour: str, step: int, t: float, y: float | None, **extra: Any) -> None:
            entry = appends.setdefault(uid, {"chart": chart, "uid": uid, "name": name, "color": colour, "x": [], "y": [], "customdata": [], **extra})
            entry["x"].append(round(t - self.t0, 3))
            entry["y"].append(None if y is None else float(f"{y:.6g}"))
            entry["customdata"].append(step)

        for row in sorted(rows, key=lambda r: (r.step, r.t, r.id)):
            if row.name == "outer_norm":
                # Every worker applies the same outer step: the first one's is the run's.
                if self.worker_ranks and row.rank == min(self.worker_ranks):
                    add("compression", f"outer_norm:{row.rank}", "outer step: |mean change|", OUTER_COLOR,
                        row.step, row.t, row.value, yaxis="y2", mode="lines+markers")
            elif row.name == "outer_staleness":
                if row.rank not in self.server_ranks:
                    add("batch", f"staleness:{row.rank}", f"outer step late, {worker_label(row.rank)}",
                        color(self._index(row.rank)), row.step, row.t, row.value, yaxis="y2", mode="markers")
            elif row.name in LATE_CHANGES:
                if row.rank in self.server_ranks:
                    legend, _, colour, symbol = LATE_CHANGES[row.name]
                    add("batch", f"{row.name}:{row.rank}", legend, colour, row.step, row.t, row.value, yaxis="y3",
                        mode="markers", symbol=symbol, hovertemplate=late_change_hover(row.name))
            elif row.name in _CHART_OF:
                if row.rank in self.server_ranks and row.name != "loss":
                    continue  # the server's own rates would count its workers twice
                chart, prefix = _CHART_OF[row.name]
                index = self._index(row.rank)
                label = loss_label(row.rank, self.server_ranks) if row.name == "loss" else worker_label(row.rank)
                add(chart, f"{prefix}:{row.rank}", label, color(index), row.step, row.t, row.value)
                if row.name == "samples_per_s" and row.value is not None:
                    self._total(row, add)
            elif row.name == "bytes_sent" and row.peer >= 0 and row.value is not None:
                self._egress(row, add)
            elif is_evaluation_metric(row.name):
                if row.name not in self.eval_names:
                    self.eval_names.append(row.name)
                add("evaluation", eval_uid(row.name, row.rank), row.name, eval_color(row.name, self.eval_names),
                    row.step, row.t, row.value, mode="lines+markers")
        return list(appends.values())

    def _index(self, rank: int) -> int:
        ranks = list(self.worker_ranks)
        return ranks.index(rank) if rank in ranks else len(ranks) + rank

    def _total(self, row: MetricRow, add: Any) -> None:
        self.latest_sps[row.rank] = float(row.value)  # type: ignore[arg-type]
        if set(self.worker_ranks) <= set(self.latest_sps) and row.step > self.last_total_step:
            self.last_total_step = row.step
            add("throughput", "sps:total", "total", TOTAL_COLOR, row.step, row.t, sum(self.latest_sps[r] for r in self.worker_ranks))

    def _egress(self, row: MetricRow, add: Any) -> None:
        rate = self.link_rates.get((row.rank, row.peer))
        if rate is None:
            return
        total = self.egress_usd_by_class.get(rate.traffic_class, Decimal(0))
        total += egress_usd(int(row.value), rate.usd_per_gb)  # type: ignore[arg-type]
        self.egress_usd_by_class[rate.traffic_class] = total
        add("egress", f"egress:{rate.traffic_class}", rate.traffic_class.replace("_", " "),
            CLASS_COLORS.get(rate.traffic_class, "#6c757d"), row.step, row.t, float(round_usd(total)))


class EventRow(Protocol):
    """A stored run event, as `app.models.RunEvent` has it."""

    id: int
    t: datetime
    kind: str
    subject: int | None
    step: int | None
    detail: str
    source: Any


def event_view(event: EventRow, t0: float) -> dict[str, Any]:
    """An event as the page's timeline and chart markers draw it (x: seconds since `t0`)."""
    who = f"rank {event.subject}" if event.subject is not None else "run"
    return {
        "id": event.id,
        "x": round(event.t.timestamp() - t0, 3),
        "at": event.t.isoformat().replace("+00:00", "Z"),
        "kind": event.kind,
        "label": f"{event.kind.replace('_', ' ')}: {who}",
        "subject": event.subject,
        "step": event.step,
        "detail": event.detail,
        "source": str(getattr(event.source, "value", event.source)),
        "color": event_color(event.kind),
    }


class EventFeed:
    """The run's new events for an open page: read by id with the same late-commit care as the
    metrics (`IdCursor`), handed out once each."""

    def __init__(self, after_id: int, *, t0: float, settle_s: float = 2.0) -> None:
        self.cursor = IdCursor(after_id, settle_s=settle_s)
        self.t0 = t0
        self.sent = after_id
        self._pending: list[dict[str, Any]] = []

    @property
    def floor(self) -> int:
        """Read rows with ids above this."""
        return self.cursor.floor

    def read(self, rows: Iterable[EventRow], now: float) -> None:
        """Take the rows read with `id > floor`; those not handed out before wait in `take()`."""
        fresh = self.cursor.fresh(((r.id, r) for r in rows), now)
        for row in sorted(fresh, key=lambda r: (r.t, r.id)):
            self._pending.append(event_view(row, self.t0))
            self.sent = max(self.sent, row.id)

    def take(self) -> list[dict[str, Any]]:
        """The events not handed out yet, oldest first."""
        out, self._pending = self._pending, []
        return out
