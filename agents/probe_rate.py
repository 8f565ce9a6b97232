"""The rate of a probe's bulk transfer from the receiver's reads: (time, cumulative bytes)
samples reduced to the whole transfer, its second half, and the median of steady windows after
the head (agents.probe's answer to a bulk send)."""

from __future__ import annotations

import bisect
import statistics
from typing import Any

# The steady-state window: the share of the first-to-last-byte time left out as the head (TCP's
# slow start, a token bucket's burst), and the windows the rest is cut into (the rate is their
# median, which a stall of either end's CPU does not move).
HEAD_SHARE = 0.3
STEADY_WINDOWS = 7


def bulk_answer(samples: list[tuple[float, int]]) -> dict[str, Any]:
    """The receiver's count and times: the whole transfer, its second half, and the median
    rate of the windows after the head.

    The bytes of the first read arrived before the clock started, so `timed_bytes` leaves them
    out. The second half (`steady_*`, from the last read before the midpoint on) leaves out
    TCP's slow start. `steady_mbps` leaves out the first HEAD_SHARE of the time (slow start, a
    token bucket's burst) and takes the median over STEADY_WINDOWS equal windows of the rest,
    the bytes at a window's edges interpolated between reads.
    """
    if not samples:
        return {"bytes": 0, "timed_bytes": 0, "seconds": 0.0, "steady_bytes": 0, "steady_seconds": 0.0,
                "steady_mbps": 0.0}
    (first, first_count), (last, count) = samples[0], samples[-1]
    middle = first + (last - first) / 2
    times = [t for t, _ in samples]
    t0, c0 = samples[max(0, bisect.bisect_right(times, middle) - 1)]
    return {
        "bytes": count, "timed_bytes": count - first_count, "seconds": last - first,
        "steady_bytes": count - c0, "steady_seconds": last - t0,
        "steady_mbps": steady_window_mbps(samples),
    }


def steady_window_mbps(samples: list[tuple[float, int]], head: float = HEAD_SHARE,
                       windows: int = STEADY_WINDOWS) -> float:
    """Median Mbit/s over `windows` equal windows of (time, cumulative bytes) `samples` after
    the first `head` share of their span; 0 when the span is empty."""
    (first, _), (last, _) = samples[0], samples[-1]
    span = last - first
    if span <= 0 or len(samples) < 2:
        return 0.0
    times = [t for t, _ in samples]

    def bytes_at(t: float) -> float:
        i = bisect.bisect_right(times, t)
        if i == 0:
            return float(samples[0][1])
        if i == len(samples):
            return float(samples[-1][1])
        (ta, ca), (tb, cb) = samples[i - 1], samples[i]
        return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else float(cb)

    start = first + head * span
    width = (last - start) / windows
    rates = sorted((bytes_at(start + (k + 1) * width) - bytes_at(start + k * width)) * 8 / width / 1e6
                   for k in range(windows))
    return statistics.median(rates)
