"""What one-step-delayed updates (`--delayed-updates`) cost in convergence and save in step time:
`ps-bz-gc` with and without them, side by side in one invocation, over loopback.

    .venv/bin/python bench/delayed_updates.py --out results-delayed-updates.json

Each configuration trains the same task with the same seeds (runs alternate between the
configurations seed by seed, so drift in the host's speed hits all of them) and evaluates every
`--eval-every` steps. Per run: the final accuracy, the first evaluated step at or above
`--threshold`, the step time (a worker's batch read, compute and push/pull, median over the
steps after warm-up that follow no evaluation, since an evaluation applies a delayed run's
pending update and would flatter the next step) and the workers' wait for the server's reply.
`--variant` adds a delayed configuration with other task arguments (a lower rate, no momentum),
to show what the delay asks of the hyperparameters. Ratios are to the configuration without delay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from taskpath import train  # noqa: E402 - the bench folder is not a package

ROOT = Path(__file__).resolve().parent.parent
# The paper benchmark's compression settings (docs/BENCHMARKS.md, "Paper benchmark").
COMMON = ["--strategy", "ps-bz-gc", "--density", "0.05", "--density-min", "0.02", "--density-max", "0.1",
          "--server-k-fraction", "0.125", "--warmup-steps", "1", "--threads", "1"]
# Steps before the step time is read: the dense warm-up step and the first compressed ones.
SETTLE_STEPS = 3


def run(task: str, task_args: str, extra: list[str], *, seed: int, args: argparse.Namespace, out: Path) -> dict:
    """One run of `python -m trainer`; its figures, read from its metrics."""
    records, wall_s = train(ROOT, [*COMMON, "--task", task, "--task-args", task_args, *extra,
                                   "--workers", str(args.workers), "--global-batch", str(args.global_batch),
                                   "--seed", str(seed), "--max-steps", str(args.steps),
                                   "--eval-every", str(args.eval_every)], out)
    return {"seed": seed, "wall_s": round(wall_s, 1), **figures(records, args.threshold)}


def figures(records: list[dict], threshold: float) -> dict:
    """Final accuracy, the first evaluated step at `threshold`, median step time and wait."""
    accuracy = {r["step"]: r["value"] for r in records if r["name"] == "accuracy" and r["rank"] == 0}
    evaluated = set(accuracy)
    workers = sorted({r["rank"] for r in records if r["rank"] > 0})

    def per_step(name: str) -> dict[int, dict[int, float]]:
        out: dict[int, dict[int, float]] = {}
        for r in records:
            if r["name"] == name and r["rank"] > 0:
                out.setdefault(r["step"], {})[r["rank"]] = r["value"]
        return out

    rate, data, batch, wait = (per_step(n) for n in ("samples_per_s", "data_s", "batch_size", "wait_s"))
    steps = [s for s in sorted(rate) if s > SETTLE_STEPS and s - 1 not in evaluated
             and all(w in rate[s] and w in data.get(s, {}) for w in workers)]
    # A step's time on a worker: reading its batch, then compute and push/pull (samples / samples_per_s);
    # the workers move in lockstep, so the mean over them is the run's step.
    step_s = [statistics.mean(data[s][w] + batch[s][w] / rate[s][w] for w in workers) for s in steps]
    waits = [statistics.mean(wait[s].values()) for s in steps if s in wait]
    reached = [s for s in sorted(accuracy) if accuracy[s] >= threshold]
    return {
        "final_accuracy": accuracy[max(accuracy)] if accuracy else None,
        "steps_to_threshold": reached[0] if reached else None,
        "step_s": statistics.median(step_s) if step_s else None,
        "wait_s": statistics.median(waits) if waits else None,
        "accuracy": accuracy,
    }


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def summarise(name: str, rows: list[dict], base: dict | None) -> dict:
    """A configuration's means over its seeds, and its ratios to `base` (the undelayed one's)."""
    acc = [r["final_accuracy"] for r in rows if r["final_accuracy"] is not None]
    reached = [r["steps_to_threshold"] for r in rows if r["steps_to_threshold"] is not None]
    step = statistics.mean(r["step_s"] for r in rows)
    wait = statistics.mean(r["wait_s"] for r in rows)
    out = {"config": name, "final_accuracy": _mean_sd(acc), "final_accuracy_mean": statistics.mean(acc),
           "steps_to_threshold": reached, "reached": f"{len(reached)}/{len(rows)}",
           "steps_to_threshold_mean": statistics.mean(reached) if reached else None,
           "step_s": step, "wait_s": wait}
    if base is not None:
        out["step_time_ratio"] = step / base["step_s"]
        out["accuracy_points"] = 100 * (out["final_accuracy_mean"] - base["final_accuracy_mean"])
        if out["steps_to_threshold_mean"] is not None and base["steps_to_threshold_mean"] is not None:
            out["steps_ratio"] = out["steps_to_threshold_mean"] / base["steps_to_threshold_mean"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every configuration over every seed, print the table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="hybridtrain.tasks.digits:widecnn")
    p.add_argument("--task-args", default='{"lr": 0.1}')
    p.add_argument("--variant", action="append", default=[],
                   help="task arguments (JSON) of one more delayed configuration; repeatable")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = {"synchronous": (args.task_args, []), "delayed": (args.task_args, ["--delayed-updates"])}
    for variant in args.variant:
        configs[f"delayed, {variant}"] = (variant, ["--delayed-updates"])
    results: dict[str, list[dict]] = {name: [] for name in configs}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name, (task_args, extra) in configs.items():
                out = Path(tmp) / f"{len(results[name])}-{name}.jsonl"
                r = run(args.task, task_args, extra, seed=seed, args=args, out=out)
                results[name].append(r)
                print(f"  {name} seed {seed}: accuracy {r['final_accuracy']:.4f}, {args.threshold} at step "
                      f"{r['steps_to_threshold']}, step {r['step_s']:.3f} s ({r['wall_s']:.0f} s)", flush=True)
    base = summarise("synchronous", results["synchronous"], None)
    rows = [base] + [summarise(name, results[name], base) for name in list(configs)[1:]]
    print(f"\n{args.task} {args.task_args}, ps-bz-gc, {args.workers} workers on loopback, B={args.global_batch}, "
          f"{args.steps} steps, evaluated every {args.eval_every}, seeds {args.seeds}; "
          f"{(time.monotonic() - t0) / 60:.1f} min")
    print(f"| configuration | final accuracy | vs synchronous (points) | steps to {args.threshold} (reached) "
          "| vs synchronous | step (s) | step time vs synchronous | worker wait (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        steps = f"{r['steps_to_threshold_mean']:.1f}" if r["steps_to_threshold_mean"] is not None else "never"
        points = f"{r['accuracy_points']:+.2f}" if "accuracy_points" in r else ""
        steps_ratio = f"{r['steps_ratio']:.2f}" if "steps_ratio" in r else ("" if r is base else "n/a")
        ratio = f"{r['step_time_ratio']:.3f}" if "step_time_ratio" in r else ""
        print(f"| {r['config']} | {r['final_accuracy']} | {points} | {steps} ({r['reached']}) | {steps_ratio} "
              f"| {r['step_s']:.3f} | {ratio} | {r['wait_s']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"task": args.task, "task_args": args.task_args,
                                              "workers": args.workers, "global_batch": args.global_batch,
                                              "steps": args.steps, "eval_every": args.eval_every, "seeds": seeds,
                                              "threshold": args.threshold, "runs": results, "summary": rows},
                                             indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
