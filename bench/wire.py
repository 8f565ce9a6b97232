"""Bytes on the wire per step and direction, for every strategy at default settings.

    .venv/bin/python bench/wire.py --out results-wire.json

Runs each strategy through the real CLI (4 workers, gloo on 127.0.0.1) and reads the per-link
byte counts from its metrics. "up" is what one worker sends per step (to the server, or to its
ring neighbour for all-reduce), "down" what it receives; both are averaged over workers and over
the steady-state steps (after the dense warm-up / PowerSGD start, excluding evaluation steps).
PS counts are exact frame bytes; all-reduce counts follow the ring model (see trainer/ddp.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STRATEGIES = ("allreduce", "allreduce-powersgd", "ps", "ps-gc", "ps-bz-gc")


def run(strategy: str, model: str, steps: int, workers: int, tmp: Path) -> dict:
    """One short run; mean bytes per worker per step in each direction."""
    out = tmp / f"{strategy}-{model}.jsonl"
    cmd = [sys.executable, "-m", "trainer", "--strategy", strategy, "--task", f"hybridtrain.tasks.digits:{model}",
           "--workers", str(workers), "--max-steps", str(steps), "--eval-every", str(steps),
           "--metrics-out", str(out), "--threads", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    first = 12  # past the 5 dense warm-up steps and PowerSGD's start at step 10
    worker_ranks = {r["rank"] for r in records if r["role"] == "worker"}
    up, down = [], []
    for r in records:
        if r["rank"] in worker_ranks and first <= r["step"] < steps:
            (up if r["name"] == "bytes_sent" else down if r["name"] == "bytes_recv" else []).append(r["value"])
    return {"strategy": strategy, "model": model, "steps_measured": steps - first,
            "up_bytes_per_step": sum(up) / len(up), "down_bytes_per_step": sum(down) / len(down)}


def main(argv: list[str] | None = None) -> int:
    """Run every strategy, print the table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smallcnn,widemlp")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            rows = [run(s, model, args.steps, args.workers, Path(tmp)) for s in STRATEGIES]
            ps = next(r for r in rows if r["strategy"] == "ps")
            print(f"\n{model}, {args.workers} workers, default settings (bytes per worker per step)")
            print("| strategy | up (bytes) | down (bytes) | up+down | ps / this |\n|---|---|---|---|---|")
            for r in rows:
                total = r["up_bytes_per_step"] + r["down_bytes_per_step"]
                r["ps_over_this"] = (ps["up_bytes_per_step"] + ps["down_bytes_per_step"]) / total
                print(f"| {r['strategy']} | {r['up_bytes_per_step']:,.0f} | {r['down_bytes_per_step']:,.0f} | "
                      f"{total:,.0f} | {r['ps_over_this']:.1f}x |")
            results.extend(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
