"""How much of a worker's step its input pipeline takes, on a data set read from disk.

    .venv/bin/python bench/dataloader.py --out results-dataloader.json

Writes N shapes images as one .npy file each (bench/tasks/disk_images.py), then trains the
task through the real CLI (ps-bz-gc, 2 workers) with 0 and with 2 DataLoader processes per
worker (`--data-workers`), side by side. Before each run the page cache is dropped when this
runs as root (`/proc/sys/vm/drop_caches`), so the first epoch really reads the disk. A worker's
input share is the time its training loop waited for the next batch (`data_s`) over its step
time (its batch / its samples/s), summed over its steps after the first; goal < 5 %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def drop_page_cache() -> bool:
    """Ask the kernel to drop clean cached pages (root only); whether it worked."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run(root: Path, loaders: int, steps: int, batch: int, out: Path) -> dict:
    """One run; per worker, the input pipeline's share of the step."""
    dropped = drop_page_cache()
    cmd = [sys.executable, "-m", "trainer", "--strategy", "ps-bz-gc", "--workers", "2", "--threads", "1",
           "--task", "disk_images:task", "--task-args", json.dumps({"root": str(root)}),
           "--global-batch", str(batch), "--max-steps", str(steps), "--eval-every", str(steps),
           "--data-workers", str(loaders), "--metrics-out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench" / "tasks"), str(ROOT)]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    shares = {}
    for rank in (1, 2):
        data = {r["step"]: r["value"] for r in records if r["rank"] == rank and r["name"] == "data_s"}
        rate = {r["step"]: r["value"] for r in records if r["rank"] == rank and r["name"] == "samples_per_s"}
        size = {r["step"]: r["value"] for r in records if r["rank"] == rank and r["name"] == "batch_size"}
        later = [s for s in data if s > 1 and s in rate]
        step_s = sum(size[s] / rate[s] + data[s] for s in later)
        shares[rank] = sum(data[s] for s in later) / step_s
    server = [r["value"] for r in records if r["rank"] == 0 and r["name"] == "samples_per_s" and r["step"] > 1]
    return {"data_workers": loaders, "cache_dropped": dropped, "input_share": shares,
            "samples_per_s": statistics.median(server)}


def main(argv: list[str] | None = None) -> int:
    """Write the files, run both settings, print the table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=4000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench" / "tasks"))
    from disk_images import write_images

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        write_images(root, args.samples)
        for loaders in (0, 2):
            rows.append(run(root, loaders, args.steps, args.global_batch, Path(tmp) / f"m{loaders}.jsonl"))
    print(f"\n{args.samples} images on disk (.npy, 12 KiB each), 2 workers, B={args.global_batch}, "
          f"{args.steps} steps")
    print("| --data-workers | worker 1 input share | worker 2 input share | samples/s | cache dropped |")
    print("|---|---|---|---|---|")
    for r in rows:
        s = r["input_share"]
        print(f"| {r['data_workers']} | {s[1]:.1%} | {s[2]:.1%} | {r['samples_per_s']:.1f} | {r['cache_dropped']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
