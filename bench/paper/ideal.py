"""The ideal a benchmark's throughput is read against: each worker node computing alone, in its
own namespace and cgroup, on the batch the plan gives it; the sum over the nodes is the ideal.
Also the global batch re-chosen so that a balanced step computes for a set time on any host."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from testbed import processes
from bench.paper.paper_workloads import BenchSettings, calibrate, workdir_of
from testbed.errors import TestbedError
from testbed.state import TestbedState

Log = Callable[[str], None]


def profile_argv(s: BenchSettings, batch: int) -> list[str]:
    """The trainer's profiler measuring one worker's compute alone (forward, backward and
    optimizer step of the task) on `batch` samples; it prints one JSON line with samples_per_s."""
    code = ["--code-dir", str(workdir_of(s))] if s.workdir else []
    return [sys.executable, "-m", "trainer.profile", "--task", s.task,
            "--task-args", json.dumps(s.task_args), "--batch", str(batch), "--device", "cpu",
            "--seconds", str(s.standalone_seconds), *code]  # fmt: skip


def measure_ideal(
    state: TestbedState, state_dir: Path, batch_by_node: dict[str, int], s: BenchSettings, log: Log
) -> dict[str, float]:
    """samples/s of each worker node computing alone (all at once: the quotas keep them apart)."""
    records = {}
    for node, batch in batch_by_node.items():
        ep = state.endpoints[node]
        records[node] = processes.spawn(
            state, state_dir, name=f"standalone-{node}",
            argv=profile_argv(s, batch), netns_name=ep["netns"], cgroup=Path(ep["cgroup"]),
        )  # fmt: skip
    if processes.wait_for_exit(list(records.values()), timeout_s=s.standalone_seconds * 10 + 120):
        raise TestbedError("the standalone measurement did not finish")
    rates = {}
    for node, record in records.items():
        rate = samples_per_s(Path(record.log).read_text())
        if rate is None:
            raise TestbedError(f"standalone run on {node} failed; see {record.log}")
        rates[node] = round(rate, 2)
    log(f"  standalone: {rates} -> ideal {sum(rates.values()):.1f} samples/s")
    return rates


def measure_calibrated(s: Any, ideal_at: Callable[[Any], dict[str, float]], workers: int, log: Log, *,
                       smallest: int, largest: int) -> tuple[Any, dict[str, float], dict[str, Any] | None]:
    """The standalone rates at the batch of settings `s` (`ideal_at`); with `s.balanced_step_s`,
    the batch re-chosen from them (paper_workloads.calibrate) and the rates measured again at it.
    Returns the settings run with, their rates and the calibration record (None: not calibrated)."""
    standalone = ideal_at(s)
    if not s.balanced_step_s:
        return s, standalone, None
    # Hosts differ by 2x in compute while the links keep the paper's bandwidths: a fixed batch
    # would make the run more or less communication-bound from one host to the next.
    calibration, lines = calibrate(standalone, s.balanced_step_s, s.global_batch, workers,
                                   smallest=smallest, largest=largest)
    for line in lines:
        log(line)
    if calibration["global_batch"] != s.global_batch:
        s = replace(s, global_batch=calibration["global_batch"])
        standalone = ideal_at(s)
    return s, standalone, calibration


def samples_per_s(output: str) -> float | None:
    """The samples_per_s of the last JSON line in a measurement's output, None without one.

    The log holds stderr too, so a warning may follow the profiler's one JSON line.
    """
    for line in reversed(output.splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("samples_per_s"), int | float):
            return float(value["samples_per_s"])
    return None
