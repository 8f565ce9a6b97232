"""cgroup v1 CPU quotas: each emulated node computes at a share of a core set by its GPU's FLOPs.

One directory per testbed under /sys/fs/cgroup/cpu (`ht-{testbed}`), one child per endpoint.
A quota of q cores is cfs_quota_us = q * cfs_period_us. The trainers run torch with one thread
(see `PINNED_THREADS_ENV`), so a quota below one core is exactly the share of time the node
computes; with more threads a process would burst through its quota and then stall.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from testbed.system import CGROUP_CPU_ROOT
from testbed.topology import CPU_PERIOD_US, MIN_QUOTA_US, PREFIX

# Set in the environment of every process the testbed starts, so torch, OpenMP and BLAS each
# use one thread and child processes (trainer roles) inherit the same.
PINNED_THREADS_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "TORCH_NUM_INTEROP_THREADS": "1",
}


# A node's agent runs beside its quota, not on it: heartbeats, log shipping and Celery are the
# host's work on a real machine, and on a 0.157-core quota they would cost a V100 node ~10 %
# of its compute during runs (but not in the standalone measurement). Its own small quota
# keeps an agent from crowding out the nodes all the same.
HOST_CORES = 0.25


def group_path(testbed_cgroup: str, endpoint: str | None = None) -> Path:
    """The cpu cgroup directory of a testbed, or of one endpoint in it (its "GPU")."""
    base = CGROUP_CPU_ROOT / testbed_cgroup
    return base / endpoint if endpoint else base


def host_group_path(testbed_cgroup: str, endpoint: str) -> Path:
    """The cgroup of an endpoint's host processes (its agent)."""
    return CGROUP_CPU_ROOT / testbed_cgroup / "host" / endpoint


# A quota is a ceiling, not a guarantee: when the machine is busy (other processes, or the
# testbed's own overhead) CFS divides time by cpu.shares, equal (1024) by default, so a node with
# a large quota would lose more than one with a small quota and the FLOPs ratios would drift.
# Shares in proportion to the quota keep the ratios, and the testbed's own group outweighs the
# processes outside it, up to the sum of its quotas (which `check_cpu_budget` keeps below the
# machine's cores, so the rest of the machine always keeps some time).
TESTBED_SHARES = 262_144  # the kernel's maximum
SHARES_PER_CORE = 10_240


def create(path: Path, cpu_cores: float | None = None) -> None:
    """Create a cpu cgroup; with `cpu_cores`, a quota of that many cores and shares to match.

    None: the testbed's own group (no quota, the highest weight); 0: a plain grouping group.
    """
    path.mkdir(exist_ok=True)
    (path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
    if cpu_cores is None:
        (path / "cpu.shares").write_text(str(TESTBED_SHARES))
        return
    if cpu_cores <= 0:
        return  # a plain grouping directory
    quota = max(MIN_QUOTA_US, round(cpu_cores * CPU_PERIOD_US))
    (path / "cpu.cfs_quota_us").write_text(str(quota))
    (path / "cpu.shares").write_text(str(max(2, round(cpu_cores * SHARES_PER_CORE))))


def join(path: Path, pid: int | None = None) -> None:
    """Move process `pid` (default: the caller) into the cgroup; its children follow it."""
    (path / "cgroup.procs").write_text(str(pid if pid is not None else os.getpid()))


def pids(path: Path) -> list[int]:
    """The processes in this cgroup (not its children)."""
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def threads(path: Path) -> list[int]:
    """The thread ids in this cgroup (`tasks`; `pids` gives their processes)."""
    try:
        return [int(t) for t in (path / "tasks").read_text().split()]
    except FileNotFoundError:
        return []


def move_thread(path: Path, tid: int) -> None:
    """Move the one thread `tid` into the cgroup (its process's other threads stay)."""
    (path / "tasks").write_text(str(tid))


def usage(path: Path) -> dict[str, int]:
    """cpu.stat of the cgroup: periods, throttled periods and throttled nanoseconds."""
    stats: dict[str, int] = {}
    try:
        for line in (path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            stats[key] = int(value)
    except FileNotFoundError:
        pass
    return stats


def quota_cores(path: Path) -> float | None:
    """The quota of the cgroup in cores, or None when unlimited."""
    quota = int((path / "cpu.cfs_quota_us").read_text())
    period = int((path / "cpu.cfs_period_us").read_text())
    return None if quota < 0 else quota / period


def remove_tree(path: Path, *, grace_s: float = 3.0) -> None:
    """Kill whatever still runs in the cgroup tree, then remove it, children first."""
    if not path.exists():
        return
    children = [p for p in path.iterdir() if p.is_dir()]
    for child in children:
        remove_tree(child, grace_s=grace_s)
    _kill_all(path, grace_s)
    # rmdir can fail for a moment while killed tasks are still being reaped.
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            _kill_all(path, 0.0)
            time.sleep(0.1)
    path.rmdir()


def _kill_all(path: Path, grace_s: float) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        members = pids(path)
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids(path) and time.monotonic() < deadline:
            time.sleep(0.05)


def list_testbed_groups() -> list[Path]:
    """Every testbed cgroup on this machine (directories named `ht-*`)."""
    return sorted(p for p in CGROUP_CPU_ROOT.glob(f"{PREFIX}*") if p.is_dir())
