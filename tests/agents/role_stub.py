"""A stand-in for a trainer role in the agent's process-management tests.

It takes the trainer's launch flags (and ignores those it does not know), prints its pids,
optionally starts a child of its own (to check that a cancel reaches grandchildren too),
prints lines for a while and exits with a chosen code. The real trainer runs in the
end-to-end tests; here what matters is processes, signals and output.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--lines", type=int, default=3)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--ignore-term", action="store_true")
    args, _unknown = parser.parse_known_args()

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = None
    if args.spawn_child:
        # A grandchild of the guard that ignores SIGTERM: only a group SIGKILL ends it.
        child = subprocess.Popen(
            [sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"]
        )
    print(f"PIDS role={os.getpid()} child={child.pid if child else 0} pgid={os.getpgrp()}", flush=True)
    print(f"argv {' '.join(sys.argv[1:])}", flush=True)
    deadline = time.monotonic() + args.sleep
    for i in range(args.lines):
        print(f"line {i}", flush=True)
    while time.monotonic() < deadline:
        time.sleep(0.05)
    print("bye", flush=True)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
