"""CPU quotas: each emulated node computes at a share of a core set by its GPU's FLOPs.

One directory per testbed (`ht-{testbed}`) in the hierarchy that holds the cpu controller
(cgroup v1's /sys/fs/cgroup/cpu or cgroup v2's /sys/fs/cgroup, `testbed.cgroup_fs.detect`), one
child per endpoint. A quota of q cores is q * CPU_PERIOD_US of CPU time every CPU_PERIOD_US
(v1 `cpu.cfs_quota_us`, v2 `cpu.max`). The trainers run torch with one thread (see
`PINNED_THREADS_ENV`), so a quota below one core is exactly the share of time the node
computes; with more threads a process would burst through its quota and then stall.

The functions here are the interface the rest of the testbed uses; they act on the detected
hierarchy (`hierarchy()`), which tests may replace with `use()`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from testbed.cgroup_fs import CpuHierarchy, detect
from testbed.topology import PREFIX

_hierarchy: CpuHierarchy | None = None


def hierarchy() -> CpuHierarchy:
    """The CPU cgroup hierarchy of this host, detected once (TestbedError when there is none)."""
    global _hierarchy
    if _hierarchy is None:
        _hierarchy = detect()
    return _hierarchy


def use(new: CpuHierarchy | None) -> CpuHierarchy | None:
    """Act on `new` from now on (None: detect again); returns the one used before."""
    global _hierarchy
    old, _hierarchy = _hierarchy, new
    return old


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
    base = hierarchy().root / testbed_cgroup
    return base / endpoint if endpoint else base


def host_group_path(testbed_cgroup: str, endpoint: str) -> Path:
    """The cgroup of an endpoint's host processes (its agent)."""
    return hierarchy().root / testbed_cgroup / "host" / endpoint


def create(path: Path, cpu_cores: float | None = None) -> None:
    """Create a cpu cgroup; with `cpu_cores`, a quota of that many cores and a weight to match.

    None: the testbed's own group (no quota, the highest weight); 0: a plain grouping group.
    """
    hierarchy().create(path, cpu_cores)


def join(path: Path, pid: int | None = None) -> None:
    """Move process `pid` (default: the caller) into the cgroup; its children follow it."""
    hierarchy().join(path, pid if pid is not None else os.getpid())


def pids(path: Path) -> list[int]:
    """The processes in this cgroup (not its children)."""
    return hierarchy().pids(path)


def threads(path: Path) -> list[int]:
    """The thread ids in this cgroup (`pids` gives their processes)."""
    return hierarchy().threads(path)


def move_thread(path: Path, tid: int) -> None:
    """Move the one thread `tid` into the cgroup (its process's other threads stay)."""
    hierarchy().move_thread(path, tid)


def usage(path: Path) -> dict[str, int]:
    """cpu.stat of the cgroup: periods, throttled periods and throttled time (ns and us)."""
    return hierarchy().usage(path)


def quota_cores(path: Path) -> float | None:
    """The quota of the cgroup in cores, or None when unlimited."""
    return hierarchy().quota_cores(path)


def remove_tree(path: Path, *, grace_s: float = 3.0) -> None:
    """Kill whatever still runs in the cgroup tree, then remove it, children first."""
    remove_tree_of(hierarchy(), path, grace_s=grace_s)


def remove_tree_of(groups: CpuHierarchy, path: Path, *, grace_s: float = 3.0) -> None:
    """`remove_tree` in the hierarchy `groups`."""
    if not path.exists():
        return
    children = [p for p in path.iterdir() if p.is_dir()]
    for child in children:
        remove_tree_of(groups, child, grace_s=grace_s)
    _kill_all(groups, path, grace_s)
    # rmdir can fail for a moment while killed tasks are still being reaped.
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            _kill_all(groups, path, 0.0)
            time.sleep(0.1)
    path.rmdir()


def _kill_all(groups: CpuHierarchy, path: Path, grace_s: float) -> None:
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        members = groups.pids(path)
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while groups.pids(path) and time.monotonic() < deadline:
            time.sleep(0.05)


def list_testbed_groups() -> list[Path]:
    """Every testbed cgroup on this machine (directories named `ht-*`)."""
    return sorted(p for p in hierarchy().root.glob(f"{PREFIX}*") if p.is_dir())
