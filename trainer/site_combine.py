"""A remote site's relay on the way up: one frame a chunk for its whole site (`--aggregate-at-sites`).

The mirror of the update's relay (`trainer.relay`): the site's other workers send their chunks
to the relay over the local network; the relay weights them and its own by batch share (eq. 1-2
within the site), re-sparsifies the sum at its own density with an error-feedback residual per
chunk of its own, and sends the server one frame. The frame counts the site's samples; the last
chunk's carries every member's own figures (loss, compute and transmission times), so the
server's plan still sees each worker.

Choice (the paper is silent): the relay waits for its members three quarters of a step time
(`trainer.membership.relay_wait_s`), less than the server's loss deadline, so that it leaves out
a lost or silent member and
still reaches the server in time; the server, finding a member missing from the site's frame,
drops it or lets it go (docs/elastic.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable

from trainer.algorithm import aggregate_sparsified
from trainer.compression import CompressionState, Compressor, Payload
from trainer.frames import BYE, Grad, ProtocolError, expect
from trainer.transport import Inbox
from trainer.wire import peek_kind


class SiteCombiner:
    """The relay's side of per-site aggregation: its members, the wait for their chunks, and
    the residual of the re-sparsified sum (one state per chunk)."""

    def __init__(self, rank: int, members: tuple[int, ...], bounds: list[tuple[int, int]], codec: Compressor,
                 *, seed: int) -> None:  # fmt: skip
        self.rank = rank
        self.members = members
        self.bounds = bounds
        self.codec = codec
        # Each state's density and step are the frame's own, set at every combine.
        self.states = [CompressionState(seed=seed) for _ in bounds]

    def keep(self, ranks: Iterable[int]) -> list[int]:
        """Keep only the members among `ranks` (the server's word on who is in); the ones left out."""
        ranks = set(ranks)
        gone = [m for m in self.members if m not in ranks]
        self.members = tuple(m for m in self.members if m in ranks)
        return gone

    def combine(self, own: Grad, inbox: Inbox, *, density: float, dense_step: bool, wait_s: float) -> Grad:
        """The site's frame of `own`'s chunk, waiting at most `wait_s` for the members' chunks.

        Its `topk_s` is the relay's own compression and the combining, not the wait:
        re-balancing reads compression as a worker's fixed cost a step, the wait is communication.
        """
        t0 = time.perf_counter()
        members, waited = self._chunks(own.step, own.chunk, inbox, wait_s)
        group = [own, *members]
        a, b = self.bounds[own.chunk]
        state = self.states[own.chunk]
        state.density = density
        state.step = own.step
        dense, combined = aggregate_sparsified(group, own.dense.numel, b - a, codec=self.codec, state=state,
                                               dense_step=dense_step)
        last = own.chunk == len(self.bounds) - 1
        spent = own.topk_s + time.perf_counter() - t0 - waited
        mine = (own.sender, own.loss, own.samples, own.compute_s, own.last_tx_s, spent, own.site_s)
        return Grad(own.step, self.rank, own.chunk, own.loss, sum(g.samples for g in group), own.compute_s,
                    own.last_tx_s, spent, Payload(dense.numel(), dense),
                    combined,
                    (mine, *(m.own() for m in members)) if last else (), own.site_s)

    def _chunks(self, step: int, chunk: int, inbox: Inbox, wait_s: float) -> tuple[list[Grad], float]:
        """The members' frames of `chunk`, and the seconds spent waiting for them. A member whose
        connection ends, that leaves (its BYE) or that sends nothing within `wait_s` is left out
        from now on."""
        t0 = time.monotonic()
        deadline = t0 + wait_s
        out = []
        for m in self.members:
            try:
                raw = inbox.get(m, timeout_s=max(0.0, deadline - time.monotonic()))[0]
            except (ConnectionError, TimeoutError, OSError) as exc:
                why = f"silent for {wait_s:.1f} s after this relay's own chunk" if isinstance(exc, TimeoutError) else exc
                print(f"[worker rank {self.rank}] site member {m} lost in step {step} ({why}); the site's "
                      "frames go on without it", file=sys.stderr, flush=True)
                self.members = tuple(r for r in self.members if r != m)
                continue
            if peek_kind(raw) == BYE:  # leaving the run (a spot notice)
                self.members = tuple(r for r in self.members if r != m)
                continue
            grad = expect(raw, Grad, step, peer=m)
            if grad.chunk != chunk:
                raise ProtocolError(f"relay {self.rank}: expected chunk {chunk} of step {step} from "
                                    f"rank {m}, got chunk {grad.chunk}")
            out.append(grad)
        return out, time.monotonic() - t0
