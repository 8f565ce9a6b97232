"""Batch-size allocation across heterogeneous workers (seed 000, section III-A).

Step 1 of the algorithm: n_m = B * s_m / sum(s), rounded so that sum(n_m) == B and n_m >= 1.
Step 2: the aggregation weights alpha_m = n_m / B (eq. 1).
"""

from __future__ import annotations

from collections.abc import Sequence

ALLOCATIONS = ("equal", "flops", "measured")


def proportional_batch_sizes(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """Split `global_batch` in proportion to `speeds`: sums exactly to B, every share >= 1.

    Largest-remainder rounding after reserving one sample per worker, so the rounding error of any
    share is below one sample and ties break towards the lower worker index (deterministic on
    every rank).
    """
    m = len(speeds)
    if m == 0:
        raise ValueError("speeds: at least one worker is required")
    if any(not (s > 0) for s in speeds):
        raise ValueError(f"speeds: every speed must be > 0, got {list(speeds)}")
    if global_batch < m:
        raise ValueError(f"global batch {global_batch} is smaller than the {m} workers")
    total = float(sum(speeds))
    # Reserve the guaranteed sample first so a very slow worker still gets n_m >= 1 without
    # taking more than its share from the others.
    spare = global_batch - m
    exact = [spare * s / total for s in speeds]
    sizes = [int(e) for e in exact]
    left = spare - sum(sizes)
    order = sorted(range(m), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    return [n + 1 for n in sizes]


def equal_batch_sizes(global_batch: int, workers: int) -> list[int]:
    """Equal shares of `global_batch` (the first `B mod M` workers get one more)."""
    return proportional_batch_sizes(global_batch, [1.0] * workers)


def aggregation_weights(batch_sizes: Sequence[int]) -> list[float]:
    """alpha_m = n_m / sum(n) (eq. 1)."""
    total = sum(batch_sizes)
    return [n / total for n in batch_sizes]


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
    alone exceeds T keeps the one-sample minimum.
    """
    speeds = measured_speeds(batch_sizes, compute_s)
    if not overhead_s:
        return proportional_batch_sizes(global_batch, speeds)
    finish = (global_batch + sum(s * c for s, c in zip(speeds, overhead_s, strict=True))) / sum(speeds)
    shares = [max(s * (finish - c), 1e-9) for s, c in zip(speeds, overhead_s)]
    return proportional_batch_sizes(global_batch, shares)
