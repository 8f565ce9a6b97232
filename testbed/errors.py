"""Errors of the testbed, in one tree:

    TestbedError
    ├── NeedsRootError        not root: namespaces, tc and cgroups need it
    ├── ConfigError           the YAML config is invalid (the message names the field)
    ├── NoCpuCgroupError      neither cgroup v1 nor v2 has the cpu controller; carries what was seen
    ├── CommandError          a system command (ip, tc) failed; carries its argv and stderr
    └── ServiceError          a process of the testbed (control plane, agent) did not come up
"""

from __future__ import annotations

from collections.abc import Sequence

NEEDS_ROOT_MESSAGE = "hybridtrain testbed needs root (network namespaces, tc, cgroups)"


class TestbedError(Exception):
    """Base of every error the testbed raises on purpose."""

    __test__ = False  # not a pytest test class, despite the name


class NeedsRootError(TestbedError):
    """The testbed was asked to change the system without root."""

    def __init__(self) -> None:
        super().__init__(NEEDS_ROOT_MESSAGE)


class ConfigError(TestbedError):
    """A testbed config file is invalid."""


class NoCpuCgroupError(TestbedError):
    """No mounted cgroup hierarchy (v1 or v2) has the cpu controller."""

    FIX = ("mount cgroup2 with cpu in its cgroup.controllers (the default on current distributions) "
           "or the v1 cpu controller at /sys/fs/cgroup/cpu")

    def __init__(self, seen: str) -> None:
        self.seen = seen
        super().__init__(f"the testbed needs the cpu controller of cgroup v1 or v2; found {seen}: {self.FIX}")


class CommandError(TestbedError):
    """A system command exited non-zero."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"`{' '.join(self.argv)}` failed ({returncode}): {self.stderr}")


class ServiceError(TestbedError):
    """A testbed service failed to start or to become ready."""
