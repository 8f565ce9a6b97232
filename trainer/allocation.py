"""Batch-size allocation across heterogeneous workers (seed 000, section III-A).

Step 1 of the algorithm: n_m = B * s_m / sum(s), rounded so that sum(n_m) == B and n_m >= 1.
Step 2: the aggregation weights alpha_m = n_m / B (eq. 1).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridtrain.contract import (  # noqa: F401 - the batch split lives once, in the contract
    ALLOCATIONS,
    aggregation_weights,
    equal_batch_sizes,
    proportional_batch_sizes,
)


def measured_speeds(batch_sizes: Sequence[int], compute_s: Sequence[float]) -> list[float]:
    """Observed samples/s per worker from its batch size and mean compute time of a window."""
    return [n / max(t, 1e-9) for n, t in zip(batch_sizes, compute_s, strict=True)]


def rebalance(
    global_batch: int,
    batch_sizes: Sequence[int],
    compute_s: Sequence[float],
    overhead_s: Sequence[float] = (),
) -> list[int]:
    """`measured` allocation: re-split B from the compute times observed with `batch_sizes`, so
    that every worker's gradient is ready at once, counting its per-step `overhead_s` too.

    A worker takes c_m + n_m / s_m for a batch of n_m (s_m its measured speed, c_m a cost that
    does not grow with the batch: compressing a gradient of fixed size). Equal finishing times
    T give n_m = s_m (T - c_m) with T = (B + sum s_m c_m) / sum s_m; a worker whose overhead
    alone exceeds T keeps the one-sample minimum. The whole samples are then the ones whose
    last worker finishes first (`soonest_finish`), not the nearest to those shares.
    """
    speeds = measured_speeds(batch_sizes, compute_s)
    overheads = list(overhead_s) or [0.0] * len(speeds)
    finish = (global_batch + sum(s * c for s, c in zip(speeds, overheads, strict=True))) / sum(speeds)
    shares = [max(s * (finish - c), 1e-9) for s, c in zip(speeds, overheads)]
    return soonest_finish(global_batch, speeds, overheads, start=proportional_batch_sizes(global_batch, shares))


def soonest_finish(global_batch: int, speeds: Sequence[float], overhead_s: Sequence[float],
                   start: Sequence[int]) -> list[int]:
    """Whole batch sizes summing to `global_batch` (each >= 1) whose slowest worker, at
    c_m + n_m / s_m, finishes first: from `start`, each sample moved from the worker that
    finishes last to the one that would finish soonest with it, while that is sooner.

    Rounding the exact shares to the nearest can leave the last worker a sample over its share
    at the slowest per-sample speed: under sites as replicas a cloud worker's eighth sample on
    charlm is 0.28 s a round that every site waits for, where the on-prem worker that gets it
    instead adds 0.09 s (docs/trainer.md).
    """
    sizes = list(start)
    if sum(sizes) != global_batch or min(sizes) < 1:
        raise ValueError(f"start: {list(start)} must be >= 1 each and sum to {global_batch}")

    def done(i: int, n: int) -> float:
        return overhead_s[i] + n / speeds[i]

    for _ in range(global_batch):  # each move lowers the slowest finish or ends the loop
        last = max(range(len(sizes)), key=lambda i: (done(i, sizes[i]), -i))
        if sizes[last] <= 1:
            break
        to = min((i for i in range(len(sizes)) if i != last), key=lambda i: (done(i, sizes[i] + 1), i), default=None)
        if to is None or done(to, sizes[to] + 1) >= done(last, sizes[last]):
            break
        sizes[last] -= 1
        sizes[to] += 1
    return sizes
