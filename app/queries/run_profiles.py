"""Profiles from runs: a succeeded run's measured step times refresh its nodes' profiles.

Each worker's compute per step (`compute_s`, with its `batch_size`) is what the profiler
measures in a few seconds, measured over a whole run: once the run has succeeded, the median
samples/s of each worker's steps (less the first few, which warm caches up) becomes its node's
newest finished profile of the run's task, or of its script (`profiled_as`), at the batch the
worker ran. The entry is marked as from the run (`created_by` "run N", `result.source` "run",
`result.run_id`), so a plan says where each input comes from; its spread is (p90 - p10) /
median of the per-step samples/s and its repeats the steps counted.

The task's size (params, dense part, compression costs) is not what a run measures: it is
carried over from the newest profile of the same task; a script, which the profiler cannot
measure, takes its size from the server's `params` metric (a PS run) with the dense part, the
1-D tensors, counted as none.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.models import ProfileStatus, Run, RunStatus, RunWorker, TaskProfile
from app.models.base import utcnow
from app.models.runs import RunMetric
from app.queries.profiles import latest_profiles, profiled_as, task_key

log = logging.getLogger(__name__)

# The first steps of a worker allocate buffers and warm caches; the profiler drops them too.
WARMUP_STEPS = 3
# Fewer measured steps than this say too little to replace a profile.
MIN_STEPS = 3
SOURCE_RUN = "run"
# The fields of a profile's result that its measurement sets, not the task's size.
_MEASUREMENT = frozenset({"samples_per_s", "step_s", "spread", "repeats", "samples_per_s_runs", "batch",
                          "batch_size", "source", "run_id"})


def run_marker(run_id: int) -> str:
    """The `created_by` of the profiles a run's measurements made."""
    return f"run {run_id}"


def _rates(session: Session, run_id: int, ranks: list[int]) -> dict[int, list[tuple[float, float]]]:
    """Each rank's (batch, compute_s) per step after the warm-up, in step order."""
    rows = session.execute(
        select(RunMetric.rank, RunMetric.step, RunMetric.name, RunMetric.value)
        .where(RunMetric.run_id == run_id, RunMetric.rank.in_(ranks),
               RunMetric.name.in_(("compute_s", "batch_size")))
    ).all()
    steps: dict[int, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for rank, step, name, value in rows:
        if value is not None:
            steps[rank][step][name] = float(value)
    out: dict[int, list[tuple[float, float]]] = {}
    for rank, by_step in steps.items():
        measured = [(s["batch_size"], s["compute_s"]) for _, s in sorted(by_step.items())
                    if s.get("batch_size", 0) > 0 and s.get("compute_s", 0) > 0]
        out[rank] = measured[WARMUP_STEPS:]
    return out


def _size(session: Session, run: Run, base: TaskProfile | None) -> dict[str, Any]:
    """The task's size for a profile of `run`: the base profile's, or the run's params metric."""
    if base is not None and base.result:
        # The profiler's own runs measured another thing than this run's steps.
        return {k: v for k, v in base.result.items() if k not in _MEASUREMENT}
    params = session.scalar(
        select(func.max(RunMetric.value)).where(RunMetric.run_id == run.id, RunMetric.name == "params"))
    if params is None:
        return {}
    return {"params": int(params), "dense_params": 0, "dense_params_assumed": True}


def profiles_from_run(session: Session, *, run: Run, now: datetime | None = None) -> list[TaskProfile]:
    """The profiles a succeeded run's measured steps make (flushed), one per worker node that
    has enough steps and none from this run yet; none for a run that has not succeeded."""
    if run.status != RunStatus.succeeded:
        return []
    now = now or utcnow()
    ref, args = profiled_as(task=run.task, task_args=run.task_args, script=run.script,
                            script_args=run.script_args)
    key = task_key(ref, args, run.bundle_sha256)
    workers: list[RunWorker] = [w for w in run.workers if w.role == "worker" and w.node_id is not None]
    done = set(session.scalars(select(TaskProfile.node_id).where(
        TaskProfile.task_key == key, TaskProfile.created_by == run_marker(run.id))))
    workers = [w for w in workers if w.node_id not in done]
    if not workers:
        return []
    rates = _rates(session, run.id, [w.rank for w in workers])
    previous = latest_profiles(session, task_key=key, node_ids=[w.node_id for w in run.workers if w.node_id])
    # The task's size is the same on every node: any node's newest profile speaks for it.
    newest = max(previous.values(), key=lambda p: p.id, default=None)
    made: list[TaskProfile] = []
    for worker in workers:
        measured = rates.get(worker.rank, [])
        if len(measured) < MIN_STEPS or worker.node_id in {p.node_id for p in made}:
            continue
        per_s = [batch / compute for batch, compute in measured]
        median = statistics.median(per_s)
        batch = int(statistics.median(b for b, _ in measured))
        base = previous.get(worker.node_id) or newest
        deciles = statistics.quantiles(per_s, n=10, method="inclusive")
        spread = (deciles[-1] - deciles[0]) / median
        result = {**_size(session, run, base), "samples_per_s": median,
                  "step_s": statistics.median(c for _, c in measured), "spread": spread,
                  "repeats": len(measured), "batch": batch, "source": SOURCE_RUN, "run_id": run.id}
        made.append(TaskProfile(
            node_id=worker.node_id, task_key=key, task=ref, task_args=args, bundle_sha256=run.bundle_sha256,
            batch_size=batch, device=run.device, status=ProfileStatus.done,
            params=result.get("params"), train_samples=base.train_samples if base else None,
            eval_samples=base.eval_samples if base else None, samples_per_s=median,
            step_s=result["step_s"], spread=spread, repeats=len(measured),
            metrics=dict(base.metrics or {}) if base else {}, result=result,
            created_by=run_marker(run.id), created_at=now, measured_at=now,
        ))
    session.add_all(made)
    session.flush()
    return made


def refresh_profiles(session: Session, *, run: Run, now: datetime | None = None) -> None:
    """`profiles_from_run`, never failing the caller's transaction: a run's end or a rank's
    exit is recorded whatever its measurements say."""
    try:
        with session.begin_nested():
            made = profiles_from_run(session, run=run, now=now)
    except Exception:  # noqa: BLE001 - a profile is a by-product; the run's own record comes first
        log.exception("could not refresh profiles from run %s", run.id)
        return
    if made:
        log.info("run %s refreshed the profiles of nodes %s", run.id, [p.node_id for p in made])
