"""A node's cgroup quota holds a busy loop to its share of a core."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from testbed import cgroups, processes
from testbed.state import TestbedState

BUSY = (
    "import os, time\n"
    "t = time.monotonic()\n"
    "while time.monotonic() - t < 2.0: pass\n"
    "c = os.times(); print(c.user + c.system)\n"
)


def test_quota_limits_a_busy_loop(two_sites: TestbedState, state_dir: Path) -> None:
    group = Path(two_sites.endpoints["cloud-a"]["cgroup"])
    assert cgroups.quota_cores(group) == pytest.approx(0.157)
    record = processes.spawn(
        two_sites, state_dir, name="busy", argv=[sys.executable, "-c", BUSY],
        netns_name=two_sites.endpoints["cloud-a"]["netns"], cgroup=group,
    )  # fmt: skip
    while processes.is_alive(record):
        time.sleep(0.1)
    cpu_s = float(Path(record.log).read_text().split()[-1])
    # Two seconds of wall time at 0.157 core is 0.31 s of CPU; interpreter start-up adds a little.
    assert 0.15 < cpu_s < 0.5
    assert cgroups.usage(group)["nr_throttled"] > 0


def test_spawned_process_lives_in_its_namespace_and_cgroup(
    two_sites: TestbedState, state_dir: Path
) -> None:
    ep = two_sites.endpoints["lab-a"]
    code = "import time; time.sleep(30)"
    record = processes.spawn(
        two_sites, state_dir, name="sleeper", argv=[sys.executable, "-c", code],
        netns_name=ep["netns"], cgroup=Path(ep["cgroup"]),
    )  # fmt: skip
    try:
        assert record.pid in cgroups.pids(Path(ep["cgroup"]))
        from testbed import netns

        assert record.pid in netns.namespace_pids(ep["netns"])
    finally:
        processes.stop(record)
    assert not processes.is_alive(record)


def test_waiting_for_spawned_processes_leaves_no_zombie(two_sites: TestbedState, state_dir: Path) -> None:
    records = [
        processes.spawn(two_sites, state_dir, name=f"short-{node}", argv=[sys.executable, "-c", "pass"],
                        netns_name=two_sites.endpoints[node]["netns"],
                        cgroup=Path(two_sites.endpoints[node]["cgroup"]))
        for node in ("lab-a", "cloud-a")
    ]  # fmt: skip
    assert processes.wait_for_exit(records, timeout_s=60) == []
    for record in records:
        assert not psutil.pid_exists(record.pid)

