"""Running `ip` and `tc`, and the checks that the machine can host a testbed."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from testbed.errors import CommandError, NeedsRootError, TestbedError


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> str:
    """Run a command and return its stdout; raise CommandError if it fails and `check`."""
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stderr)
    return proc.stdout


def require_root() -> None:
    """Raise NeedsRootError unless this process is root."""
    if os.geteuid() != 0:
        raise NeedsRootError()


def require_tools() -> None:
    """Raise a clear error when `ip`, `tc` or a cgroup cpu controller (v1 or v2) is missing."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"the testbed needs `{tool}` (iproute2) on PATH")
    from testbed.cgroup_fs import detect

    detect()
