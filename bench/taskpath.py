"""Is the task path as fast as the built-in path it replaced? Side by side, in one invocation.

    .venv/bin/python bench/taskpath.py --baseline 5ca0eeb --out results-taskpath.json

"before" is the trainer of git revision --baseline (the last one with built-in model and data
set names), unpacked with `git archive` into a temporary directory and run from there with
`--model widecnn --dataset digits`; "after" is this tree's trainer with
`--task hybridtrain.tasks.digits:widecnn`, which reads its batches through a DataLoader and
calls the task's loss, optimizer and schedule. Both run the paper benchmark's workload (widecnn
on digits, ps-bz-gc, 4 workers at the paper's relative speeds, the same global batch, seed and
compression settings) on this machine, alternating A B A B so that drift in the host's speed
hits both. Throughput is the server's samples/s per step, median over the steps after the
dense warm-up; the ratio is after / before (goal >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--strategy", "ps-bz-gc", "--workers", "4", "--speeds", "1,0.89,0.39,0.39", "--seed", "0",
          "--warmup-steps", "1", "--server-k-fraction", "0.125", "--threads", "1"]


def unpack_revision(revision: str, dest: Path) -> None:
    """The tree of `revision` under `dest` (git archive: nothing in the checkout changes)."""
    data = subprocess.run(["git", "archive", "--format=tar", revision], cwd=ROOT, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")


def train(tree: Path, args: list[str], out: Path) -> tuple[list[dict], float]:
    """`python -m trainer *args` from the trainer of `tree`, one thread a process; its metric
    records (written to `out`) and its wall seconds. A failed run stops the benchmark."""
    cmd = [sys.executable, "-m", "trainer", *args, "--metrics-out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return records, time.monotonic() - t0


def run(tree: Path, args: list[str], steps: int, batch: int, out: Path) -> dict:
    """One run; the server's median samples/s after warm-up, and the wall time."""
    records, wall_s = train(tree, [*COMMON, *args, "--global-batch", str(batch), "--max-steps", str(steps),
                                   "--eval-every", str(steps)], out)
    rates = [r["value"] for r in records if r.get("name") == "samples_per_s" and r["rank"] == 0 and r["step"] > 2]
    return {"samples_per_s": statistics.median(rates), "steps": len(rates), "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    """Alternate before/after runs, print the table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="5ca0eeb", help="git revision of the built-in path")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    configs = {
        "before": ["--model", "widecnn", "--dataset", "digits", "--lr", "0.1"],
        "after": ["--task", "hybridtrain.tasks.digits:widecnn", "--task-args", '{"lr": 0.1}'],
    }
    results: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        unpack_revision(args.baseline, base)
        trees = {"before": base, "after": ROOT}
        for i in range(args.repeats):
            for name in configs:
                r = run(trees[name], configs[name], args.steps, args.global_batch, Path(tmp) / f"{name}{i}.jsonl")
                results[name].append(r)
                print(f"  {name} #{i + 1}: {r['samples_per_s']:.1f} samples/s ({r['wall_s']:.0f} s)", flush=True)
    means = {name: statistics.mean(r["samples_per_s"] for r in rows) for name, rows in results.items()}
    ratio = means["after"] / means["before"]
    print(f"\nwidecnn on digits, ps-bz-gc, 4 workers, B={args.global_batch}, {args.steps} steps, "
          f"{args.repeats} runs each (alternated)")
    print("| path | samples/s (mean of runs) | runs |\n|---|---|---|")
    for name, rows in results.items():
        runs = ", ".join(f"{r['samples_per_s']:.1f}" for r in rows)
        print(f"| {name} | {means[name]:.1f} | {runs} |")
    print(f"| **after / before** | **{ratio:.3f}** | goal >= 0.97 |")
    if args.out:
        Path(args.out).write_text(json.dumps({"baseline": args.baseline, "steps": args.steps,
                                              "global_batch": args.global_batch, "runs": results,
                                              "means": means, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
