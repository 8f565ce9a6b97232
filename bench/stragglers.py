"""Asynchronous outer steps with a straggler in every round, with and without the server going on
without it (docs/trainer.md, "A staleness-aware server"): an in-process `diloco` run of 3
workers on threads (the tests' tiny MLP, AdamW), inner steps paced to `--pace` seconds, and in
each round one worker in turn stalling `--stall` seconds before its change. Without deferral the
server waits for every change (the worker side hides up to H - 1 inner steps of it); with it a
round closes at its deadline (the floor lowered to 30 ms: the threads report no compute time).

    .venv/bin/python bench/stragglers.py --sync-every 5 --stall 0.3 --reps 3

Prints a table of the two servers (medians): the wall time and its ratio to the waiting server,
the server's outer_deferred/folded/dropped totals, whether the replicas ended equal, and the
workers' mean loss over their last 5 steps; each run to stderr and all of them to `--out`
(JSON). The runs alternate; the first pair warms the process up and is not reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "trainer"))
sys.path.insert(0, str(ROOT / "tests"))

WORKERS, STEPS = 3, 60
COUNTS = ("outer_deferred", "outer_folded", "outer_dropped")


def run_once(every: int, pace_s: float, stall_s: float, *, defer: bool) -> dict:
    """One run; the server's deferral on or off (off: every round waits for every change)."""
    import torch
    from trainer_testing import adamw, config, flat_parameters, run_in_process

    from trainer.config import TrainConfig
    from trainer.metrics import MetricsLogger

    counts = dict.fromkeys(COUNTS, 0.0)
    log = MetricsLogger.log

    def record(self, step, name, value, peer=None):
        if self.rank == 0 and name in counts:
            counts[name] += value
        log(self, step, name, value, peer)

    def pace(rank: int, step: int, run) -> None:
        # Round k's straggler is worker k % 3 + 1; it stalls before the round's last inner step.
        stalls = step % every == every - 1 and (step // every) % WORKERS + 1 == rank
        time.sleep(stall_s if stalls else pace_s)

    cfg = config(strategy="diloco", workers=WORKERS, global_batch=48, sync_every=every, max_steps=STEPS,
                 asynchronous=True, pipeline_chunks=2, dense_numel=100)
    defers = TrainConfig.defers_late_changes
    MetricsLogger.log = record  # type: ignore[method-assign]
    TrainConfig.defers_late_changes = property(lambda self: defer and defers.fget(self))  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        run = run_in_process(cfg, STEPS, optimizer=adamw, after_step=pace)
        wall = time.perf_counter() - t0
    finally:
        MetricsLogger.log, TrainConfig.defers_late_changes = log, defers  # type: ignore[method-assign]
    flats = [flat_parameters(m) for m in run.models]
    return {"defer": defer, "wall_s": round(wall, 2), **{k: int(v) for k, v in counts.items()},
            "replicas_equal": all(torch.equal(flats[0], f) for f in flats[1:]),
            "last5_loss": round(sum(sum(v[-5:]) / 5 for v in run.losses.values()) / WORKERS, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync-every", type=int, default=5)
    parser.add_argument("--pace", type=float, default=0.03, help="seconds an inner step takes")
    parser.add_argument("--stall", type=float, default=0.3, help="seconds a round's straggler stalls")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results-stragglers.json"), help="the runs, as JSON")
    args = parser.parse_args()
    from trainer import late_changes

    late_changes.DEADLINE_FLOOR_S = 0.03
    runs: list[dict] = []
    for rep in range(args.reps + 1):
        for defer in (False, True):  # alternated, so that the host's drift falls on both alike
            result = run_once(args.sync_every, args.pace, args.stall, defer=defer)
            if rep:
                runs.append(result)
                print(result, file=sys.stderr, flush=True)
    print(f"H = {args.sync_every}, inner step {args.pace} s, a straggler a round stalling {args.stall} s; "
          f"medians of {args.reps} runs each")
    print("| server | wall s | x waiting | deferred | folded | dropped | replicas equal | loss, last 5 steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    waiting = statistics.median(r["wall_s"] for r in runs if not r["defer"])
    for defer, name in ((False, "waits for every change"), (True, "goes on without a straggler")):
        mine = [r for r in runs if r["defer"] == defer]
        wall = statistics.median(r["wall_s"] for r in mine)
        counts = " | ".join(str(statistics.median(r[k] for r in mine)) for k in COUNTS)
        print(f"| {name} | {wall:.2f} | {wall / waiting:.3f} | {counts} | {all(r['replicas_equal'] for r in mine)} "
              f"| {statistics.median(r['last5_loss'] for r in mine):.3f} |")
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
