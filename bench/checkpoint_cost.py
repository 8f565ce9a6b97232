"""What a scheduled checkpoint costs the steps around it: no checkpoints, checkpoints every N
steps off the step's path (this tree), and the same at --baseline (the last revision that took
them on the path), side by side in one invocation over loopback.

    .venv/bin/python bench/checkpoint_cost.py --baseline f7a5c02 --out results-checkpoint-cost.json

Every configuration trains widecnn on digits with ps-bz-gc, 4 workers at the paper's relative
speeds, four pipeline chunks and the paper benchmark's compression settings, the same seed and
global batch; runs alternate between the configurations repeat by repeat, so drift in the
host's speed hits all of them. A step's time is the gap between the server's samples/s records
of consecutive steps. The steps "after a checkpoint" are the two that follow each checkpointed
boundary (the state's transfer and the file's write fall in them, on the path or off it); the
"others" are the rest after the dense warm-up. The same step numbers are read for the run
without checkpoints, which sets the bar. Per run: the medians of both, and the extra seconds a
checkpoint costs (the two steps after it, less two median other steps, averaged over the
checkpoints); ratios: after / others, and each configuration's mean step time over the one
without checkpoints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybridtrain.contract import EVENT_CHECKPOINT  # noqa: E402
from taskpath import train, unpack_revision  # noqa: E402 - the bench folder is not a package

ROOT = Path(__file__).resolve().parent.parent
# The paper benchmark's workload and compression settings (docs/BENCHMARKS.md, "Paper benchmark").
COMMON = ["--strategy", "ps-bz-gc", "--task", "hybridtrain.tasks.digits:widecnn", "--task-args", '{"lr": 0.1}',
          "--workers", "4", "--speeds", "1,0.89,0.39,0.39", "--pipeline-chunks", "4",
          "--density", "0.05", "--density-min", "0.02", "--density-max", "0.1", "--server-k-fraction", "0.125",
          "--warmup-steps", "1", "--threads", "1", "--seed", "0"]
# Steps before step times are read: the dense warm-up step and the first compressed ones.
SETTLE_STEPS = 3


def run(tree: Path, every: int, args: argparse.Namespace, work: Path) -> dict:
    """One run of `python -m trainer` from `tree`; its step times, split around checkpoints."""
    cmd = [*COMMON, "--global-batch", str(args.global_batch), "--max-steps", str(args.steps),
           "--eval-every", str(args.steps)]
    if every:
        cmd += ["--checkpoint-every", str(every), "--checkpoint-dir", str(work / "checkpoints")]
    records, wall_s = train(tree, cmd, work / "metrics.jsonl")
    checkpoints = sorted({r["step"] for r in records if r.get("event") == EVENT_CHECKPOINT})
    return {"wall_s": round(wall_s, 1), "checkpoints": checkpoints, **split_steps(records, args.every)}


def step_times(records: list[dict]) -> dict[int, float]:
    """Step -> seconds since the server's record of the step before (rank 0's samples/s)."""
    at = {r["step"]: r["t"] for r in records if r.get("name") == "samples_per_s" and r["rank"] == 0}
    return {s: at[s] - at[s - 1] for s in sorted(at) if s - 1 in at}


def split_steps(records: list[dict], every: int) -> dict:
    """Median step time of the two steps after each checkpointed boundary and of the others."""
    times = {s: t for s, t in step_times(records).items() if s > SETTLE_STEPS}
    # The two steps after each boundary past the first checkpoint: s - 1 or s - 2 a multiple of `every`.
    near = {s for s in times if s > every and (s - 1) % every in (0, 1)}
    after = [times[s] for s in sorted(near)]
    others = [t for s, t in times.items() if s not in near]
    usual = statistics.median(others)
    return {"after_s": statistics.median(after), "others_s": usual,
            "extra_per_checkpoint_s": (sum(after) - len(after) * usual) / (len(after) / 2),
            "mean_step_s": statistics.mean(times.values()), "after_max_s": max(after), "steps": len(times)}


def main(argv: list[str] | None = None) -> int:
    """Alternate the configurations, print the table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="f7a5c02", help="git revision whose checkpoints are on the step's path")
    p.add_argument("--every", type=int, default=5, help="--checkpoint-every of the runs that checkpoint")
    p.add_argument("--steps", type=int, default=41)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.every < 2 or args.steps < SETTLE_STEPS + 2 * args.every:
        p.error("give --every >= 2 and --steps of at least two checkpoints after the warm-up")
    names = ["no checkpoints", f"every {args.every}, off the path", f"every {args.every}, at {args.baseline}"]
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "baseline"
        unpack_revision(args.baseline, base)
        plan = {names[0]: (ROOT, 0), names[1]: (ROOT, args.every), names[2]: (base, args.every)}
        for i in range(args.repeats):
            for name, (tree, every) in plan.items():
                work = Path(tmp) / f"run-{len(results[name])}-{names.index(name)}"
                work.mkdir()
                r = run(tree, every, args, work)
                results[name].append(r)
                print(f"  {name} #{i + 1}: steps after a checkpoint {r['after_s']:.3f} s, others "
                      f"{r['others_s']:.3f} s, {r['extra_per_checkpoint_s']:+.3f} s a checkpoint, mean "
                      f"{r['mean_step_s']:.3f} s ({r['wall_s']:.0f} s)", flush=True)
    rows = {}
    for name, runs in results.items():
        after = statistics.mean(r["after_s"] for r in runs)
        others = statistics.mean(r["others_s"] for r in runs)
        mean = statistics.mean(r["mean_step_s"] for r in runs)
        extra = statistics.mean(r["extra_per_checkpoint_s"] for r in runs)
        rows[name] = {"after_s": after, "others_s": others, "after_over_others": after / others,
                      "extra_per_checkpoint_s": extra, "mean_step_s": mean}
    bar = rows[names[0]]["mean_step_s"]
    for row in rows.values():
        row["mean_over_none"] = row["mean_step_s"] / bar
    print(f"\nwidecnn on digits, ps-bz-gc, 4 workers, 4 chunks, B={args.global_batch}, {args.steps} steps, "
          f"{args.repeats} runs each (alternated); medians per run, means over runs")
    print("| configuration | steps after a checkpoint (s) | other steps (s) | after / others "
          "| extra a checkpoint (s) | mean step (s) | mean / no checkpoints |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['after_s']:.3f} | {row['others_s']:.3f} | {row['after_over_others']:.2f} "
              f"| {row['extra_per_checkpoint_s']:+.3f} | {row['mean_step_s']:.3f} | {row['mean_over_none']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"baseline": args.baseline, "every": args.every, "steps": args.steps,
                                              "global_batch": args.global_batch, "runs": results, "rows": rows},
                                             indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
