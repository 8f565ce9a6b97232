"""A stand-in for a trainer role in the agent's process-management tests.

It takes the trainer's launch flags (and ignores those it does not know), prints its pids,
optionally starts a child of its own (to check that a cancel reaches grandchildren too),
prints lines for a while and exits with a chosen code. The real trainer runs in the
end-to-end tests; here what matters is processes, signals and output.
"""

from __future__ import annotations

import argparse
import json
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
    # As a trainer's worker on a spot notice: finish the step (this long), then leave with 0.
    parser.add_argument("--leave-on-term", type=float, default=None)
    # As a trainer with undelivered reports: write this many records to --report-spool.
    parser.add_argument("--spool-records", type=int, default=0)
    parser.add_argument("--report-spool")
    # As a trainer that logged this many records to --metrics-out (and never reported them).
    parser.add_argument("--metrics-records", type=int, default=0)
    parser.add_argument("--metrics-out")
    args, _unknown = parser.parse_known_args()

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.leave_on_term is not None:
        def leave(signum: int, frame: object) -> None:
            print("SIGTERM: leaving at the step boundary", flush=True)
            time.sleep(args.leave_on_term)
            print("left", flush=True)
            os._exit(0)

        signal.signal(signal.SIGTERM, leave)
    if args.spool_records and args.report_spool:
        with open(args.report_spool, "a") as spool:
            for seq in range(args.spool_records):
                spool.write(json.dumps({"stream": f"rank{args.rank}", "seq": seq, "name": "loss",
                                        "value": 1.0 / (seq + 1), "step": seq}) + "\n")
            spool.write('{"torn": ')  # a killed writer's last line
    if args.metrics_records and args.metrics_out:
        with open(args.metrics_out, "a") as out:
            for seq in range(args.metrics_records):
                out.write(json.dumps({"rank": args.rank, "stream": f"m{args.rank}", "seq": seq, "name": "loss",
                                      "value": 1.0, "step": seq}) + "\n")
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
