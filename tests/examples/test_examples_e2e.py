"""Each example end to end on this machine, as its README runs it: the task examples through
`hybridtrain train --task`, the plain loop through `hybridtrain launch`; each must reach the
target its README states (read back from --metrics-out)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from examples_testing import EXAMPLES

pytestmark = pytest.mark.e2e

HYBRIDTRAIN = Path(sys.executable).with_name("hybridtrain")


def run_example(tmp_path: Path, example: str, argv: list[str], timeout: int) -> list[dict]:
    """Run `hybridtrain ARGV` in a copy of examples/<example> (the run writes nothing into the
    repository); return the run's metric records."""
    work = tmp_path / example
    shutil.copytree(EXAMPLES / example, work, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([str(HYBRIDTRAIN), *argv], cwd=work, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]


def assert_reached(records: list[dict], metric: str, op: str, value: float) -> None:
    assert any(r["name"] == "time_to_target_s" for r in records), "no time_to_target_s record"
    scores = [r["value"] for r in records if r["name"] == metric]
    assert scores, f"no {metric} records"
    assert (min(scores) <= value) if op == "<=" else (max(scores) >= value), scores


def test_diabetes_example_reaches_its_target_through_hybridtrain_train(tmp_path):
    records = run_example(tmp_path, "diabetes", [
        "train", "--task", "diabetes:task", "--workers", "2", "--global-batch", "64", "--max-steps", "200",
        "--eval-every", "5", "--target", "val_loss<=0.55", "--metrics-out", str(tmp_path / "metrics.jsonl"),
    ], timeout=240)
    assert_reached(records, "val_loss", "<=", 0.55)
    assert any(r["name"] == "mae" for r in records)


def test_charlm_example_reaches_its_target_through_hybridtrain_train(tmp_path):
    records = run_example(tmp_path, "charlm", [
        "train", "--task", "charlm:task", "--strategy", "allreduce", "--workers", "2", "--global-batch", "64",
        "--max-steps", "300", "--eval-every", "20", "--target", "val_loss<=0.9",
        "--metrics-out", str(tmp_path / "metrics.jsonl"),
    ], timeout=400)
    assert_reached(records, "val_loss", "<=", 0.9)


def test_plain_loop_example_reaches_its_target_through_hybridtrain_launch(tmp_path):
    records = run_example(tmp_path, "plain_loop", [
        "launch", "--workers", "2", "--target", "accuracy>=0.95",
        "--metrics-out", str(tmp_path / "metrics.jsonl"), "train.py", "--epochs", "10",
    ], timeout=300)
    assert_reached(records, "accuracy", ">=", 0.95)
