"""A plan of a task no node has profiled, for real: the CLI's `runs create --plan-only
--all-strategies` orders the profiles, two real agents on this one host run the real
`trainer.profile` one at a time (the host's profile lock) and each until stable, and the CLI
then prints every strategy's numbers with how old and noisy each input is."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime

import pytest
from conftest import ADMIN, Deployment

pytestmark = pytest.mark.e2e

TASK = "hybridtrain.tasks.digits:smallcnn"
# trainer.profile times at least this long a run (its --seconds default), and an agent makes
# at least two runs under the lock: profiles taken one after another end this far apart.
MIN_PROFILE_S = 2 * 3.0


def test_a_plan_profiles_its_task_one_node_at_a_time_and_prints_its_numbers(cluster: Deployment):
    # Two nodes: a second profile waiting for the first is what the host's lock is for; a
    # third would only repeat that wait (each profile is several fresh interpreters).
    profiled = cluster.nodes[:2]  # type: ignore[attr-defined]
    nodes = ",".join(str(n) for n in profiled)
    env = {**cluster.env, "HYBRIDTRAIN_URL": cluster.url, "HYBRIDTRAIN_TOKEN": ADMIN}
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "runs", "create", "--name", "plan", "--nodes", nodes, "--task", TASK,
         "--device", "cpu", "--plan-only", "--all-strategies", "--profile-wait", "480"],
        env=env, cwd=cluster.cwd, capture_output=True, text=True, timeout=600,
    )
    print(done.stderr + done.stdout)  # shown with -rP: the figures of this host
    assert done.returncode == 0, done.stdout + done.stderr
    assert "profiling the task on 2 node(s)" in done.stderr and "profiled in" in done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ps-bz-gc ")]
    assert rows and float(rows[0].split("|")[2]) > 0
    assert done.stdout.count("samples/s ±") == 2 and done.stdout.count(" runs), measured ") == 2

    profiles = cluster.get("/tasks/profiles", params={"limit": 10})["data"]
    ours = [p for p in profiles if p["task"] == TASK and p["status"] == "done"]
    assert sorted(p["node_id"] for p in ours) == sorted(profiled)
    assert all(p["repeats"] >= 2 and p["spread"] is not None for p in ours)
    ends = sorted(datetime.fromisoformat(p["measured_at"]) for p in ours)
    gaps = [(b - a).total_seconds() for a, b in zip(ends, ends[1:])]
    assert min(gaps) >= MIN_PROFILE_S - 0.5, gaps  # one at a time on this host
    rates = [p["samples_per_s"] for p in ours]
    # The same CPU, measured alone each time: the figures agree (at once: 42, 422 and 522).
    # Concurrent, they split the CPU tenfold; a busy host moves them apart by up to about 1.6x.
    assert max(rates) / min(rates) < 3, rates
