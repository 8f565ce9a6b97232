"""The two CPU cgroup hierarchies the testbed runs on, behind one interface: cgroup v1's cpu
controller (`cpu.cfs_quota_us`, `tasks`) and cgroup v2 (`cpu.max`, `cgroup.threads`).

`detect()` reads /proc/self/mounts and picks the hierarchy that has the cpu controller: v1's
`cgroup ... cpu` mount, else a `cgroup2` mount whose `cgroup.controllers` lists `cpu` (the
controller is in one hierarchy at a time, so a host has at most one of them). The rest of the
testbed goes through `testbed.cgroups`, which asks this module for the detected hierarchy.

On v2 the thread placer's per-thread moves need a threaded subtree: a thread moves (by
`cgroup.threads`) only between cgroups of the same threaded domain. So every group below a
testbed's own top group is made `threaded` (its `cgroup.type`), which makes the top group the
subtree's threaded domain; cpu is a threaded controller, so the quotas hold there as on v1, and
a threaded subtree has no "no internal processes" rule (the control plane runs in the top group).
A threaded cgroup's `cgroup.procs` cannot be read (EOPNOTSUPP): its processes are the thread
groups of its `cgroup.threads`.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from testbed.errors import NoCpuCgroupError, TestbedError
from testbed.topology import CPU_PERIOD_US, MIN_QUOTA_US

MOUNTS = Path("/proc/self/mounts")

# A quota is a ceiling, not a guarantee: when the machine is busy (other processes, or the
# testbed's own overhead) CFS divides time by weight, equal by default, so a node with a large
# quota would lose more than one with a small quota and the FLOPs ratios would drift. Weights in
# proportion to the quota keep the ratios, and the testbed's own group outweighs the processes
# outside it, up to the sum of its quotas (which `check_cpu_budget` keeps below the machine's
# cores, so the rest of the machine always keeps some time).
TESTBED_SHARES = 262_144  # v1's maximum cpu.shares
SHARES_PER_CORE = 10_240
MAX_WEIGHT = 10_000  # v2's maximum cpu.weight


def shares_of(cpu_cores: float) -> int:
    """v1 cpu.shares of a group with a quota of `cpu_cores`."""
    return max(2, round(cpu_cores * SHARES_PER_CORE))


def weight_of_shares(shares: int) -> int:
    """v2 cpu.weight [1, 10000] of v1 cpu.shares [2, 262144], as systemd and the kernel map them."""
    return max(1, min(MAX_WEIGHT, 1 + ((shares - 2) * 9999) // 262142))


def quota_us(cpu_cores: float) -> int:
    """The quota of `cpu_cores` per CPU_PERIOD_US (the kernel's smallest at least)."""
    return max(MIN_QUOTA_US, round(cpu_cores * CPU_PERIOD_US))


class CpuHierarchy(Protocol):
    """What the testbed does with CPU cgroups, whichever hierarchy holds the cpu controller."""

    root: Path
    version: int

    def create(self, path: Path, cpu_cores: float | None) -> None:
        """A group; `cpu_cores` None: a testbed's own (top weight, no quota); 0: only a grouping."""

    def join(self, path: Path, pid: int) -> None:
        """Move process `pid` (all its threads) into the group; its children follow it."""

    def pids(self, path: Path) -> list[int]:
        """The processes with a thread in this group (not its children)."""

    def threads(self, path: Path) -> list[int]:
        """The thread ids in this group."""

    def move_thread(self, path: Path, tid: int) -> None:
        """Move the one thread `tid` into the group (its process's other threads stay)."""

    def quota_cores(self, path: Path) -> float | None:
        """The group's quota in cores, None when unlimited."""

    def usage(self, path: Path) -> dict[str, int]:
        """cpu.stat with both `throttled_time` (ns, v1's name) and `throttled_usec` (v2's)."""


def _read_ints(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except FileNotFoundError:
        return []


def _stat(path: Path) -> dict[str, int]:
    stats: dict[str, int] = {}
    try:
        for line in (path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().lstrip("-").isdigit():
                stats[key] = int(value)
    except FileNotFoundError:
        pass
    return stats


@dataclass(frozen=True)
class V1:
    """cgroup v1's cpu controller mounted at `root` (usually /sys/fs/cgroup/cpu)."""

    root: Path
    version: int = 1

    def create(self, path: Path, cpu_cores: float | None) -> None:
        path.mkdir(exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        if cpu_cores is None:
            (path / "cpu.shares").write_text(str(TESTBED_SHARES))
            return
        if cpu_cores <= 0:
            return
        (path / "cpu.cfs_quota_us").write_text(str(quota_us(cpu_cores)))
        (path / "cpu.shares").write_text(str(shares_of(cpu_cores)))

    def join(self, path: Path, pid: int) -> None:
        (path / "cgroup.procs").write_text(str(pid))

    def pids(self, path: Path) -> list[int]:
        return _read_ints(path / "cgroup.procs")

    def threads(self, path: Path) -> list[int]:
        return _read_ints(path / "tasks")

    def move_thread(self, path: Path, tid: int) -> None:
        (path / "tasks").write_text(str(tid))

    def quota_cores(self, path: Path) -> float | None:
        quota = int((path / "cpu.cfs_quota_us").read_text())
        period = int((path / "cpu.cfs_period_us").read_text())
        return None if quota < 0 else quota / period

    def usage(self, path: Path) -> dict[str, int]:
        stats = _stat(path)
        if "throttled_time" in stats:
            stats["throttled_usec"] = stats["throttled_time"] // 1000
        return stats


@dataclass(frozen=True)
class V2:
    """The cgroup v2 (unified) hierarchy mounted at `root` (usually /sys/fs/cgroup)."""

    root: Path
    version: int = 2

    def create(self, path: Path, cpu_cores: float | None) -> None:
        path.mkdir(exist_ok=True)
        if path.parent != self.root and self._type(path) != "threaded":
            # Below a testbed's top group: threaded, so that the placer can move single threads.
            (path / "cgroup.type").write_text("threaded")
        if cpu_cores is not None and cpu_cores <= 0:
            return
        self.enable_cpu(path.parent)
        if cpu_cores is None:
            (path / "cpu.weight").write_text(str(MAX_WEIGHT))
            return
        (path / "cpu.max").write_text(f"{quota_us(cpu_cores)} {CPU_PERIOD_US}")
        (path / "cpu.weight").write_text(str(weight_of_shares(shares_of(cpu_cores))))

    def enable_cpu(self, group: Path) -> None:
        """`+cpu` in the subtree_control of `group` and of each group above it up to the root,
        so that its children get cpu.max and cpu.weight."""
        relative = group.relative_to(self.root)
        for ancestor in reversed(relative.parents):  # ".", then each level down to `group`'s parent
            self._enable(self.root / ancestor)
        self._enable(group)

    @staticmethod
    def _enable(group: Path) -> None:
        control = group / "cgroup.subtree_control"
        try:
            enabled = control.read_text().split()
        except FileNotFoundError:
            enabled = []
        if "cpu" not in enabled:
            try:
                control.write_text("+cpu")
            except OSError as exc:
                raise TestbedError(
                    f"cannot enable the cpu controller in {control}: {exc} (is cpu in "
                    f"{group / 'cgroup.controllers'}? it cannot be while a cgroup v1 hierarchy holds it)"
                ) from exc

    @staticmethod
    def _type(path: Path) -> str:
        try:
            return (path / "cgroup.type").read_text().strip()
        except FileNotFoundError:
            return ""

    def join(self, path: Path, pid: int) -> None:
        # cgroup.procs moves every thread of the process, across threaded domains too.
        (path / "cgroup.procs").write_text(str(pid))

    def pids(self, path: Path) -> list[int]:
        try:
            return _read_ints(path / "cgroup.procs")
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP:
                raise
        # A threaded group: its processes are the thread groups of its threads.
        groups: set[int] = set()
        for tid in self.threads(path):
            tgid = _tgid(tid)
            if tgid is not None:
                groups.add(tgid)
        return sorted(groups)

    def threads(self, path: Path) -> list[int]:
        return _read_ints(path / "cgroup.threads")

    def move_thread(self, path: Path, tid: int) -> None:
        (path / "cgroup.threads").write_text(str(tid))

    def quota_cores(self, path: Path) -> float | None:
        quota, _, period = (path / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or CPU_PERIOD_US)

    def usage(self, path: Path) -> dict[str, int]:
        stats = _stat(path)
        if "throttled_usec" in stats:
            stats["throttled_time"] = stats["throttled_usec"] * 1000
        return stats


def _tgid(tid: int) -> int | None:
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def detect(mounts: str | None = None) -> CpuHierarchy:
    """The hierarchy that holds the cpu controller, from /proc/self/mounts (or `mounts`, its
    text); NoCpuCgroupError saying what was seen and how to get one when neither has it."""
    text = MOUNTS.read_text() if mounts is None else mounts
    unified: list[Path] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mountpoint, fstype, options = Path(fields[1].replace("\\040", " ")), fields[2], fields[3].split(",")
        if fstype == "cgroup" and "cpu" in options:
            return V1(mountpoint)
        if fstype == "cgroup2":
            unified.append(mountpoint)
    seen = []
    for mountpoint in unified:
        try:
            controllers = (mountpoint / "cgroup.controllers").read_text().split()
        except OSError:
            controllers = []
        if "cpu" in controllers:
            return V2(mountpoint)
        seen.append(f"cgroup2 at {mountpoint} (controllers: {' '.join(controllers) or 'none'})")
    raise NoCpuCgroupError("; ".join(seen) if seen else "no cgroup mount with it")
