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
    alone exceeds T keeps the one-sample minimum.
    """
    speeds = measured_speeds(batch_sizes, compute_s)
    if not overhead_s:
        return proportional_batch_sizes(global_batch, speeds)
    finish = (global_batch + sum(s * c for s, c in zip(speeds, overhead_s, strict=True))) / sum(speeds)
    shares = [max(s * (finish - c), 1e-9) for s, c in zip(speeds, overhead_s)]
    return proportional_batch_sizes(global_batch, shares)
