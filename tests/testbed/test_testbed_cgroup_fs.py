"""The two CPU cgroup hierarchies: which one is detected, what each writes (a temp directory
stands in for the mount), and cgroup v2's threaded subtree on a real cgroup2 mount."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import cgroups
from testbed.cgroup_fs import V1, V2, detect, weight_of_shares
from testbed.errors import NoCpuCgroupError

V1_MOUNTS = (
    "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n"
    "cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n"
    "cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
)


def test_detect_takes_the_v1_cpu_controller_and_not_cpuacct():
    assert detect(V1_MOUNTS) == V1(Path("/sys/fs/cgroup/cpu"))


def test_detect_takes_v1_cpu_mounted_with_cpuacct():
    found = detect("cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n")
    assert found == V1(Path("/sys/fs/cgroup/cpu,cpuacct"))


def test_detect_takes_cgroup2_whose_controllers_list_cpu(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    found = detect(f"cgroup2 {tmp_path} cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n")
    assert found == V2(tmp_path) and found.version == 2


def test_detect_refuses_cgroup2_without_cpu_and_says_what_it_saw(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("hugetlb\n")
    with pytest.raises(NoCpuCgroupError) as caught:
        detect(f"none {tmp_path} cgroup2 rw,relatime 0 0\n")
    assert caught.value.seen == f"cgroup2 at {tmp_path} (controllers: hugetlb)"


def test_v1_writes_cfs_quota_period_and_shares(tmp_path):
    v1 = V1(tmp_path)
    v1.create(tmp_path / "ht-x", None)
    v1.create(tmp_path / "ht-x" / "a", 0.157)
    assert (tmp_path / "ht-x" / "cpu.shares").read_text() == "262144"
    node = tmp_path / "ht-x" / "a"
    assert (node / "cpu.cfs_quota_us").read_text() == "1570"
    assert (node / "cpu.cfs_period_us").read_text() == "10000"
    assert (node / "cpu.shares").read_text() == "1608"
    assert v1.quota_cores(node) == pytest.approx(0.157)


def test_v2_writes_cpu_max_weight_subtree_control_and_threaded_types(tmp_path):
    v2 = V2(tmp_path)
    top = tmp_path / "ht-x"
    v2.create(top, None)
    v2.create(top / "host", 0)
    v2.create(top / "a", 0.157)
    v2.create(top / "host" / "a", 0.25)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
    assert (top / "cpu.weight").read_text() == "10000" and not (top / "cpu.max").exists()
    assert not (top / "cgroup.type").exists()  # the top group becomes the threaded domain
    assert (top / "cgroup.subtree_control").read_text() == "+cpu"
    assert (top / "host" / "cgroup.subtree_control").read_text() == "+cpu"
    for group in (top / "host", top / "a", top / "host" / "a"):
        assert (group / "cgroup.type").read_text() == "threaded", group
    assert not (top / "host" / "cpu.max").exists()  # a grouping group
    assert (top / "a" / "cpu.max").read_text() == "1570 10000"
    assert (top / "a" / "cpu.weight").read_text() == str(weight_of_shares(1608))
    assert (top / "host" / "a" / "cpu.max").read_text() == "2500 10000"
    assert v2.quota_cores(top / "a") == pytest.approx(0.157)


def test_v2_leaves_a_controller_that_is_already_enabled(tmp_path):
    (tmp_path / "cgroup.subtree_control").write_text("cpuset cpu io memory\n")
    V2(tmp_path).create(tmp_path / "ht-x", None)
    assert (tmp_path / "cgroup.subtree_control").read_text() == "cpuset cpu io memory\n"


def test_v2_moves_processes_by_cgroup_procs_and_threads_by_cgroup_threads(tmp_path):
    v2 = V2(tmp_path)
    v2.join(tmp_path, 1234)
    v2.move_thread(tmp_path, 1240)
    assert (tmp_path / "cgroup.procs").read_text() == "1234"
    assert (tmp_path / "cgroup.threads").read_text() == "1240"
    assert v2.threads(tmp_path) == [1240]


def test_v2_quota_max_is_unlimited_and_usage_has_both_units(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cpu.stat").write_text("usage_usec 900\nnr_periods 10\nnr_throttled 4\nthrottled_usec 250\n")
    v2 = V2(tmp_path)
    assert v2.quota_cores(tmp_path) is None
    assert v2.usage(tmp_path) | {} == {"usage_usec": 900, "nr_periods": 10, "nr_throttled": 4,
                                        "throttled_usec": 250, "throttled_time": 250_000}


def test_weights_span_v2s_range_as_shares_span_v1s():
    assert (weight_of_shares(2), weight_of_shares(1024), weight_of_shares(262_144)) == (1, 39, 10_000)


def test_the_testbed_interface_acts_on_the_hierarchy_in_use(tmp_path):
    old = cgroups.use(V2(tmp_path))
    try:
        assert cgroups.group_path("ht-x", "a") == tmp_path / "ht-x" / "a"
        assert cgroups.host_group_path("ht-x", "a") == tmp_path / "ht-x" / "host" / "a"
        cgroups.create(tmp_path / "ht-x", None)
        cgroups.create(tmp_path / "ht-x" / "a", 0.5)
        assert cgroups.quota_cores(tmp_path / "ht-x" / "a") == 0.5
        assert cgroups.list_testbed_groups() == [tmp_path / "ht-x"]
    finally:
        cgroups.use(old)


# -- a real cgroup2 mount ------------------------------------------------------------------

# A process whose second thread spins: the placer's case (a stray thread beside the main one).
TWO_THREADS = (
    "import threading, time\n"
    "def spin():\n"
    "    while True: pass\n"
    "threading.Thread(target=spin, daemon=True).start()\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def cgroup2_mount(needs_root: None) -> Iterator[Path]:
    """A cgroup2 filesystem mounted on a temp directory, unmounted and removed after."""
    where = Path(tempfile.mkdtemp(prefix="ht-cgroup2-"))
    try:
        proc = subprocess.run(["mount", "-t", "cgroup2", "none", str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.fail(f"cannot mount cgroup2 on {where}: {proc.stderr.strip()}")
        try:
            yield where
        finally:
            subprocess.run(["umount", str(where)], check=True)
    finally:
        where.rmdir()


def _threads_of(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_real_cgroup2_threaded_subtree_places_a_process_and_one_of_its_threads(cgroup2_mount: Path):
    v2 = V2(cgroup2_mount)
    has_cpu = "cpu" in (cgroup2_mount / "cgroup.controllers").read_text().split()
    top = cgroup2_mount / f"ht-v2test{os.getpid()}"
    quota, host = top / "a", top / "host" / "a"
    proc = subprocess.Popen([sys.executable, "-c", TWO_THREADS])
    try:
        # Without the cpu controller (it is in a v1 hierarchy on such a host) the groups are
        # plain; with it, as on a cgroup v2 host, they carry their quotas.
        v2.create(top, None if has_cpu else 0)
        v2.create(top / "host", 0)
        v2.create(quota, 0.2 if has_cpu else 0)
        v2.create(host, 0.25 if has_cpu else 0)
        assert (top / "cgroup.type").read_text().strip() == "domain threaded"
        assert (quota / "cgroup.type").read_text().strip() == "threaded"
        deadline = time.monotonic() + 10
        while len(_threads_of(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tids = _threads_of(proc.pid)
        assert len(tids) == 2
        v2.join(quota, proc.pid)  # from outside the threaded domain, by cgroup.procs
        assert v2.pids(quota) == [proc.pid]  # read from cgroup.threads: cgroup.procs is not readable
        assert set(v2.threads(quota)) == tids
        stray = next(t for t in tids if t != proc.pid)
        v2.move_thread(host, stray)
        assert v2.threads(quota) == [proc.pid] and v2.threads(host) == [stray]
        time.sleep(0.5)
        assert v2.usage(host)["usage_usec"] > 100_000  # the spinning thread's time, counted on host
        if has_cpu:
            assert v2.quota_cores(host) == pytest.approx(0.25)
            assert v2.usage(host)["nr_throttled"] > 0
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(FileNotFoundError):
            cgroups.remove_tree_of(v2, top)
    assert not top.exists()


def test_v2_remove_tree_kills_what_is_left_in_a_threaded_group(cgroup2_mount: Path):
    v2 = V2(cgroup2_mount)
    top = cgroup2_mount / f"ht-v2rm{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        v2.create(top, 0)
        v2.create(top / "a", 0)
        v2.join(top / "a", proc.pid)
        cgroups.remove_tree_of(v2, top, grace_s=1.0)
        assert not top.exists()
        assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if top.exists():
            cgroups.remove_tree_of(v2, top)
