"""A run's progress as one line: step of max steps, throughput, the metric that matters,
elapsed and remaining time, from the newest points of rank 0's metrics (the server of PS runs,
worker 0 otherwise). `progress_line` is a pure function of (run, snapshot, now); `RunProgress`
polls the metrics API and shows it, a tqdm bar on a terminal and plain lines at most every 10 s
elsewhere (CI logs). Shared by `runs create --wait` and the benchmarks (bench/paper/api_runs.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TextIO

from hybridtrain.contract import LEGACY_TIME_TO_TARGET, SYSTEM_METRICS, VAL_LOSS, parse_target

PLAIN_EVERY_S = 10.0
# Rank 0 reports the run's loss, throughput and evaluation metrics (in PS runs it is the server).
_RANK = 0
# The states in which the run trains (a degraded one without some of its workers).
TRAINING = frozenset({"running", "degraded"})


@dataclass(frozen=True)
class Point:
    """The newest value of one metric."""

    step: int
    t: float
    value: float | None


@dataclass(frozen=True)
class Snapshot:
    """What the polls have learnt of a run's metrics so far."""

    latest: Mapping[str, Point] = field(default_factory=dict)
    # The first step seen and when: the rate since then predicts the time left without counting
    # the start-up (data loading, connecting) that precedes step 1.
    first: tuple[int, float] | None = None

    @property
    def step(self) -> int | None:
        return max((p.step for p in self.latest.values()), default=None)

    def merged(self, series: list[dict[str, Any]]) -> Snapshot:
        """This snapshot with the points of a metrics answer's `series` added."""
        latest = dict(self.latest)
        first = self.first
        for s in series:
            if s.get("peer") is not None or not s["points"]:
                continue
            step, t, value = s["points"][-1]
            known = latest.get(s["name"])
            if known is None or (step, t) >= (known.step, known.t):
                latest[s["name"]] = Point(int(step), float(t), value)
            # Step 0 records (max_steps, params) come before the first batch, not with it.
            trained = [(int(p[0]), float(p[1])) for p in s["points"] if p[0] >= 1]
            if trained and (first is None or trained[0] < first):
                first = trained[0]
        return replace(self, latest=latest, first=first)


def shown_metric(run: Mapping[str, Any], latest: Mapping[str, Point]) -> str:
    """The metric a progress line shows: the run's target metric; else the task's evaluation
    metric (its own metrics before `val_loss`, by name); else the training `loss`."""
    if run.get("target"):
        try:
            return parse_target(run["target"]).metric
        except ValueError:
            pass
    evaluated = sorted(
        (n for n in latest if n not in SYSTEM_METRICS and n != LEGACY_TIME_TO_TARGET),
        key=lambda n: (n == VAL_LOSS, n),
    )
    return evaluated[0] if evaluated else "loss"


def max_steps(run: Mapping[str, Any], latest: Mapping[str, Point]) -> int | None:
    """The run's step budget: stored on the run, or reported by the trainer (epochs runs)."""
    if run.get("max_steps"):
        return int(run["max_steps"])
    point = latest.get("max_steps")
    if point is not None and point.value is not None and point.value >= 1:
        return int(point.value)
    return None


def progress_line(run: Mapping[str, Any], snapshot: Snapshot, now: float) -> str:
    """'step 120/500 (24%) 38.2 samples/s accuracy 0.912 elapsed 1m02s left 3m15s'."""
    return " ".join(part for part in (_steps_text(run, snapshot), progress_details(run, snapshot, now)) if part)


def progress_details(run: Mapping[str, Any], snapshot: Snapshot, now: float) -> str:
    """Everything of the progress line after the steps (the tqdm bar shows those itself)."""
    latest = snapshot.latest
    parts: list[str] = []
    speed = run_samples_per_s(run, latest)
    if speed is not None:
        parts.append(f"{speed:.1f} samples/s")
    name = shown_metric(run, latest)
    point = latest.get(name)
    if point is not None:
        parts.append(f"{name} {_number(point.value)}")
    started = _started(run)
    if started is not None:
        parts.append(f"elapsed {duration(max(0.0, now - started))}")
    left = _time_left(run, snapshot)
    if left is not None:
        parts.append(f"left {duration(left)}")
    return " ".join(parts)


def run_samples_per_s(run: Mapping[str, Any], latest: Mapping[str, Point]) -> float | None:
    """The run's throughput from rank 0's latest step: its samples/s times the global batch over
    its own when that is a share of it (rank 0 of an all-reduce run is one worker). A PS server's
    batch is the global one, a local SGD server's a round's: their speed is the run's already."""
    speed, batch = latest.get("samples_per_s"), latest.get("batch_size")
    if speed is None or speed.value is None:
        return None
    total = run.get("global_batch_size")
    if total and batch is not None and batch.step == speed.step and 0 < batch.value < total:
        return speed.value * total / batch.value
    return speed.value


def _steps_text(run: Mapping[str, Any], snapshot: Snapshot) -> str:
    step = snapshot.step
    total = max_steps(run, snapshot.latest)
    if step is None:
        return "waiting for the first step" if total is None else f"step 0/{total} (0%)"
    if total is None:
        return f"step {step}"
    return f"step {step}/{total} ({min(100, math.floor(100 * step / total))}%)"


def _time_left(run: Mapping[str, Any], snapshot: Snapshot) -> float | None:
    total = max_steps(run, snapshot.latest)
    step = snapshot.step
    if total is None or step is None or snapshot.first is None:
        return None
    first_step, first_t = snapshot.first
    newest_t = max(p.t for p in snapshot.latest.values())
    if step <= first_step or newest_t <= first_t:
        return None
    per_step = (newest_t - first_t) / (step - first_step)
    return max(0, total - step) * per_step


def _started(run: Mapping[str, Any]) -> float | None:
    for key in ("started_at", "launched_at", "created_at"):
        if run.get(key):
            try:
                when = datetime.fromisoformat(str(run[key]))
            except ValueError:
                continue
            # The API writes UTC; a naive timestamp is UTC too.
            return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    return None


def _number(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "nan"
    return f"{value:.4g}" if abs(value) >= 1000 or abs(value) < 0.001 and value != 0 else f"{value:.3f}"


def status_text(run: Mapping[str, Any]) -> str:
    """'running', 'degraded (1 worker out)', 'restarting 1/3' and the like."""
    status = str(run["status"])
    restarts, most = run.get("restarts") or 0, run.get("max_restarts")
    if status == "restarting":
        return f"restarting {restarts}/{most}" if most is not None else status
    if status == "degraded":
        out = sum(1 for w in run.get("workers", []) if w.get("role") == "worker"
                  and w.get("status") in ("failed", "left", "cancelled"))
        status = f"degraded ({out} worker{'s' if out != 1 else ''} out)"
    if restarts:
        status += f", restarted {restarts}/{most}"
    return status


def duration(seconds: float) -> str:
    """62 -> '1m02s'; 3723 -> '1h02m03s'."""
    total = int(round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class RunProgress:
    """Follows one run's metrics from the API and shows them on `stream`.

    `fetch(run_id, rank=, since=, max_points=)` answers GET /runs/{id}/metrics; an error of
    `missed` is a missed poll. Call `poll(run)` with each answer of GET /runs/{id}, `note(text)`
    for a status line, `close()` at the end. Plain lines start with `label`.
    """

    def __init__(
        self,
        fetch: Callable[..., dict[str, Any]],
        stream: TextIO,
        *,
        missed: tuple[type[BaseException], ...] = (),
        label: str = "hybridtrain",
        tty: bool | None = None,
        clock: Callable[[], float] = time.time,
        every_s: float = PLAIN_EVERY_S,
    ) -> None:
        self._fetch = fetch
        self._missed = missed
        self._label = label
        self._stream = stream
        self._tty = stream.isatty() if tty is None else tty
        self._clock = clock
        self._every_s = every_s
        self.snapshot = Snapshot()
        self._since: float | None = None
        self._last_plain: float | None = None
        self._last_text = ""
        self._bar: Any = None

    def poll(self, run: Mapping[str, Any]) -> None:
        """Fetch the metrics newer than the last poll and show the progress (running runs)."""
        if run["status"] not in TRAINING:
            return
        try:
            answer = self._fetch(run["id"], rank=_RANK, since=self._since, max_points=200)
        except self._missed:
            # Progress is a courtesy: a missed poll shows up in the next one, and the wait
            # loop itself decides when the control plane is gone.
            return
        self.snapshot = self.snapshot.merged(answer.get("series", []))
        if answer.get("last_t") is not None:
            self._since = answer["last_t"]
        self._show(run)

    def note(self, text: str) -> None:
        """A line of its own (a status change), kept clear of the bar."""
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            print(text, file=self._stream, flush=True)

    def close(self) -> None:
        """Leave the bar where it is."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _show(self, run: Mapping[str, Any]) -> None:
        now = self._clock()
        if not self._tty:
            text = progress_line(run, self.snapshot, now)
            due = self._last_plain is None or now - self._last_plain >= self._every_s
            if due and text != self._last_text:
                print(f"{self._label}: {text}", file=self._stream, flush=True)
                self._last_plain, self._last_text = now, text
            return
        from tqdm import tqdm

        total = max_steps(run, self.snapshot.latest)
        if self._bar is None:
            self._bar = tqdm(total=total, file=self._stream, unit="step", dynamic_ncols=True,
                             leave=True, desc=f"{self._label}: run {run['id']}", bar_format="{desc}")
        elif total and self._bar.total != total:
            self._bar.total = total
        # Our own details go into the format itself: tqdm's postfix would lead with a comma,
        # and its elapsed time counts from this process's start, not the run's.
        details = progress_details(run, self.snapshot, now).replace("{", "{{").replace("}", "}}")
        steps = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}" if total else "step {n_fmt}"
        self._bar.bar_format = "{desc} " + steps + (" " + details if details else "")
        self._bar.n = self.snapshot.step or 0
        self._bar.refresh()
