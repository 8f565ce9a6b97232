"""The density rule's clock for one worker's upload: its bytes over the link's rate as TCP
measured it, not the time the write took.

The write returns once the kernel holds the bytes, so on a shaped link with deep socket
buffers a 1 MB frame "takes" a few milliseconds, and the server, on a slow core, often reads a
frame only after it arrived whole: both clocks then sit under the rule's floor and every
density stays at its target while the links differ tenfold (docs/BENCHMARKS.md, the paper
testbed's egress cells). TCP's delivery rate (tcpi_delivery_rate, bytes acknowledged per
second over a flight) is the link's own figure. A sample is low when the sender had too little
in flight or the receiver's window was full, so the clock takes one of the largest of the last
few (BBR's bandwidth estimate is a windowed maximum for the same reason). Not the largest: on a
loaded host ACKs are processed in bursts, which shortens both intervals a sample is measured
over, and one sample then reads well above the link (31.5 Mbit/s on a 20 Mbit/s shaper, in a
CI run); the clock takes the second largest once it has three, so one such sample is outvoted.
"""

from __future__ import annotations

from collections import deque

# Steps of delivery-rate samples the clock keeps: long enough that one full-flight sample
# survives a few app-limited steps, short enough to follow a link that slows down.
RATE_WINDOW = 8
# Samples the clock holds before it discards the largest: with two, the larger may be the outlier
# and the smaller app-limited, and neither can be told apart.
OUTVOTE_FROM = 3


class LinkClock:
    """A windowed near-maximum of one link's delivery rate, and the send time it implies."""

    def __init__(self, window: int = RATE_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._rates: deque[float] = deque(maxlen=window)

    def note(self, rate: float | None) -> None:
        """One delivery-rate sample in bytes/s; None or non-positive (no sample yet) is skipped."""
        if rate is not None and rate > 0:
            self._rates.append(float(rate))

    @property
    def rate(self) -> float | None:
        """The best recent rate in bytes/s less one outlier (the second largest of three or more
        samples), None before any sample."""
        if not self._rates:
            return None
        ranked = sorted(self._rates, reverse=True)
        return ranked[1] if len(ranked) >= OUTVOTE_FROM else ranked[0]

    def send_s(self, nbytes: int, write_s: float) -> float:
        """The step's send time: `nbytes` at the link's rate, or the write's own time where that
        is longer (a link emulated in-process by sleeping, or no rate yet)."""
        rate = self.rate
        return max(write_s, nbytes / rate) if rate else write_s
