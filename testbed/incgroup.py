"""`python -m testbed.incgroup CGROUP -- COMMAND...`: run COMMAND inside a cpu cgroup.

The agents of the testbed use it as their trainer command, so that a node's trainer roles run
on the node's GPU quota while the agent itself (heartbeats, log shipping, Celery) runs in the
node's host group: on a real machine the agent uses the host's CPU, not the GPU's time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from testbed import cgroups


def main(argv: list[str] | None = None) -> int:
    """Join the cgroup, then exec the command (same pid, so signals reach it directly)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m testbed.incgroup CGROUP -- COMMAND...", file=sys.stderr)
        return 2
    cgroups.join(Path(args[0]))
    command = args[2:]
    os.execvp(command[0], command)
    return 127  # not reached: execvp raises on failure


if __name__ == "__main__":
    sys.exit(main())
