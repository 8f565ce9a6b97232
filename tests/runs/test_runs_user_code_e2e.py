"""Users' own code end to end: `hybridtrain runs create --workdir` run as a subprocess exactly as
a user types it, against a control plane and three agents on Postgres and Redis; the examples
train to their targets, and broken code fails fast with the user's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ADMIN, ROOT, Deployment, group_alive, wait_until

from hybridtrain.contract import parse_target

pytestmark = pytest.mark.e2e

DIABETES = "examples/diabetes"
CHARLM = "examples/charlm"
PLAIN_LOOP = "examples/plain_loop"


def _user_env() -> dict[str, str]:
    # A user's shell: none of the deployment's settings, only the flags on the command line.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDTRAIN_", "CELERY_", "DATABASE_URL"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _runs_create(cluster: Deployment, name: str, *argv: str, wait: bool = True,
                 timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`hybridtrain runs create` on every node of the cluster, as a subprocess."""
    nodes = ",".join(str(n) for n in cluster.nodes)  # type: ignore[attr-defined]
    # --wait's own limit below the subprocess's, so a slow run ends as exit 3, not a hang.
    waiting = ["--wait", "--timeout", str(timeout - 30)] if wait else []
    command = [sys.executable, "-m", "app.cli", "runs", "create", "--server", cluster.url, "--token", ADMIN,
               "--name", name, "--nodes", nodes, "--device", "cpu", *waiting, *argv]
    return subprocess.run(command, env=_user_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _succeeded(cluster: Deployment, result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    run = cluster.run(json.loads(result.stdout)["id"])
    assert run["status"] == "succeeded", run["reason"]
    return run


def _points(cluster: Deployment, run_id: int, name: str) -> list[float]:
    metrics = cluster.get(f"/runs/{run_id}/metrics", params={"name": name})
    return [p[2] for s in metrics["series"] if s["name"] == name for p in s["points"] if p[2] is not None]


def _reached(cluster: Deployment, run: dict) -> float:
    """The best value of the run's target metric, asserted to meet the target; also that the
    time to target was recorded."""
    target = parse_target(run["target"])
    values = _points(cluster, run["id"], target.metric)
    assert values, f"no {target.metric} stored for run {run['id']}"
    best = max(values) if target.higher_is_better else min(values)
    assert target.reached(best), f"{target.metric} {values} never reached {target}"
    assert _points(cluster, run["id"], "time_to_target_s"), "time_to_target_s was not recorded"
    return best


def _cached_archives(cluster: Deployment, run: dict) -> dict[int, tuple[int, float]]:
    # Each node keeps the archive once, under its state dir (agents/bundles.py).
    out = {}
    for node_id in {w["node_id"] for w in run["workers"]}:
        archive = cluster.tmp / f"agent-{node_id}" / "bundles" / f"{run['bundle_sha256']}.tar.gz"
        assert archive.is_file(), f"node {node_id} has no cached archive {archive}"
        st = archive.stat()
        out[node_id] = (st.st_ino, st.st_mtime)
    return out


@pytest.fixture(scope="module")
def diabetes(cluster: Deployment) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The first run of examples/diabetes on every node (its bundle uploaded, then fetched by
    each node): the CLI's result and the run, shared by the tests that read it."""
    result = _runs_create(cluster, "diabetes", "--workdir", DIABETES, "--task", "diabetes:task",
                          "--task-args", '{"hidden": 64}', "--strategy", "ps", "--global-batch", "64",
                          "--max-steps", "60", "--eval-every", "5", "--target", "val_loss<=0.55")
    return result, _succeeded(cluster, result)


def test_diabetes_task_from_a_workdir_reaches_its_val_loss_target(cluster: Deployment, diabetes):
    result, run = diabetes
    assert run["task"] == "diabetes:task" and run["task_args"] == {"hidden": 64} and run["script"] is None
    assert run["target"] == "val_loss<=0.55"
    sha = run["bundle_sha256"]
    assert f"sha256 {sha[:12]}" in result.stderr and "(uploaded)" in result.stderr, result.stderr
    assert cluster.get(f"/bundles/{sha}")["filename"] == "diabetes.tar.gz"
    _reached(cluster, run)
    # The model trained is the user's MLP, 10 -> 64 -> 64 -> 1, not a built-in one.
    assert _points(cluster, run["id"], "params") == [10 * 64 + 64 + 64 * 64 + 64 + 64 + 1]


def test_a_second_run_of_an_unchanged_workdir_uploads_and_fetches_nothing_again(cluster: Deployment, diabetes):
    _, first = diabetes
    cached = _cached_archives(cluster, first)

    again = _runs_create(cluster, "diabetes-again", "--workdir", DIABETES, "--task", "diabetes:task",
                         "--strategy", "ps", "--global-batch", "64", "--max-steps", "5")
    second = _succeeded(cluster, again)
    assert second["bundle_sha256"] == first["bundle_sha256"]
    assert "(already on the server)" in again.stderr and "(uploaded)" not in again.stderr, again.stderr
    assert _cached_archives(cluster, second) == cached  # no node downloaded it twice


def test_charlm_task_reaches_its_own_metric_target_with_allreduce(cluster: Deployment):
    # A smaller model than the example's default, so that it trains in seconds on this CPU.
    args = {"dim": 64, "layers": 1, "context": 32, "lr": 0.01, "train_chars": 50_000, "eval_chars": 5_000}
    result = _runs_create(cluster, "charlm", "--workdir", CHARLM, "--task", "charlm:task",
                          "--task-args", json.dumps(args), "--strategy", "allreduce", "--global-batch", "48",
                          "--max-steps", "150", "--eval-every", "10", "--target", "char_accuracy>=0.45")
    run = _succeeded(cluster, result)
    assert run["task"] == "charlm:task" and run["task_args"] == args and run["bundle_sha256"]
    assert run["target"] == "char_accuracy>=0.45"
    _reached(cluster, run)
    assert _points(cluster, run["id"], "val_loss"), "val_loss is reported for every task with eval data"


def test_plain_loop_script_with_its_arguments_reaches_the_accuracy_target(cluster: Deployment):
    result = _runs_create(cluster, "plain-loop", "--workdir", PLAIN_LOOP, "--script", "train.py",
                          "--target", "accuracy>=0.9", "--", "--epochs", "12")
    run = _succeeded(cluster, result)
    assert run["script"] == "train.py" and run["script_args"] == ["--epochs", "12"] and run["bundle_sha256"]
    _reached(cluster, run)
    # The script printed its own progress: its output reached the run's logs.
    lines = [line["line"] for line in cluster.get(f"/runs/{run['id']}/logs")["lines"]]
    assert any(line.startswith("epoch ") and "accuracy" in line for line in lines), lines[-20:]


def _broken_workdir(tmp_path: Path) -> Path:
    code = tmp_path / "code"
    code.mkdir()
    (code / "present.py").write_text("VALUE = 1\n")
    (code / "broken.py").write_text(
        '"""A task that fails as it builds its data."""\n'
        "\n"
        "\n"
        "def load():\n"
        "    raise ValueError('broken on purpose')\n"
        "\n"
        "\n"
        "def task():\n"
        "    return load()\n"
    )
    return code


def _failed_fast(cluster: Deployment, result: subprocess.CompletedProcess[str], started: float) -> dict:
    """The run the CLI waited for: failed, within a minute (no rank waited out the 300 s
    rendezvous timeout), with no process of any rank left."""
    elapsed = time.monotonic() - started
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    run = cluster.run(json.loads(result.stdout)["id"])
    assert run["status"] == "failed" and elapsed < 60, (elapsed, run["reason"])
    groups = [w["pid"] for w in run["workers"] if w["pid"]]
    assert groups, run["workers"]
    wait_until(lambda: not any(group_alive(g) for g in groups), 30, "every rank of the failed run to end")
    return run


def test_a_task_module_missing_from_the_bundle_fails_the_run_fast_naming_it(cluster: Deployment, tmp_path: Path):
    started = time.monotonic()
    result = _runs_create(cluster, "missing-module", "--workdir", str(_broken_workdir(tmp_path)),
                          "--task", "missing_module:task", "--max-steps", "5", timeout=120)
    run = _failed_fast(cluster, result, started)
    assert "missing_module" in run["reason"], run["reason"]
    lines = [line["line"] for line in cluster.get(f"/runs/{run['id']}/logs")["lines"]]
    assert any("no module named 'missing_module'" in line for line in lines), lines[-20:]


def test_a_task_that_raises_fails_the_run_fast_with_the_users_traceback(cluster: Deployment, tmp_path: Path):
    started = time.monotonic()
    result = _runs_create(cluster, "broken-task", "--workdir", str(_broken_workdir(tmp_path)),
                          "--task", "broken:task", "--max-steps", "5", timeout=120)
    run = _failed_fast(cluster, result, started)
    assert "broken on purpose" in run["reason"], run["reason"]
    text = "\n".join(line["line"] for line in cluster.get(f"/runs/{run['id']}/logs")["lines"])
    # The frame of the user's file where it raised, as they would see it running it locally.
    assert 'broken.py", line 5, in load' in text, text[-3000:]


def test_a_bundle_the_server_does_not_have_is_refused_naming_bundle_sha256(cluster: Deployment):
    unknown = "0" * 64
    body = {"name": "no-bundle", "node_ids": cluster.nodes, "task": "present:task",  # type: ignore[attr-defined]
            "bundle_sha256": unknown, "max_steps": 5, "device": "cpu"}
    answer = cluster.post("/runs", body)
    assert answer.status_code == 404, answer.text
    assert "bundle_sha256" in answer.json()["detail"] and unknown in answer.json()["detail"]

    cli = _runs_create(cluster, "no-bundle", "--bundle", unknown, "--task", "present:task", wait=False, timeout=60)
    assert cli.returncode == 1 and "bundle_sha256" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
