"""Sites as replicas (`--site-replicas`, local SGD): a site's workers hold one replica, a helper
`trainer.ps.PSClient` holds. Every inner step they average their gradients over the site's LAN
through the site's relay (its lowest rank, `trainer.relay`), weighted by their samples, and each
steps the task's optimizer on that same mean: the site's replica takes one synchronous step with
the site's whole batch. Every H steps the outer step is local SGD's, one change per site: the
relay alone compresses the site's change and sends the server one frame for the site
(`trainer.site_combine`), and the server's reply crosses once per site for the relay to fan out.

Per inner step (the relay: `SiteReplica._combine`; a member: `SiteReplica._exchange`):
 1. A member posts its gradient to the relay piece by piece (`PIECE` elements, bf16: `site_dtype`)
    and reads the site's mean back piece by piece; the relay averages piece p while piece p+1
    is on the wire, so both directions of the LAN work at once.
 2. The relay takes each member's piece within the wait per-site aggregation gives its members
    (`trainer.membership.relay_wait_s`: three quarters of a step time, at least 1 s): a relay
    that waited longer would reach the next outer step later than the server waits for it, and
    be dropped itself. A member that is silent, gone or leaving is left out from then on, and
    the server, missing it from the site's next outer frame, drops it or lets it go.
 3. The mean is eq. 1-2 within the site, `site_mean`: sum_m n_m g_m / sum_m n_m over the members
    heard, in fp32, then rounded to the exchange's width. The relay sends it and copies the same
    rounded values into its own gradient, so every replica of the site steps on identical
    numbers and stays identical.

Choice (issue 49 leaves it open): through the site's relay, not an all-reduce among the site's
workers. The relay and its links exist already (it fans out the server's reply and, under
per-site aggregation, combines its site's gradients), it rides through a member's loss and a
joiner without re-forming a group, and with two workers a site (the paper's testbed) a star
moves the same bytes per link direction as a ring all-reduce: one gradient each way, the two
directions overlapped by the pieces. A site of k workers loads the relay's link k - 1 times;
a ring would spread that, and is not built. docs/trainer.md says what each costs.

A member waits for its mean until its relay's connection ends or the server says the relay is
dropped (its ROUTE), never on a clock of its own: a member that gave up on a relay that is only
slow would split its site. It then trains on as a replica of its own (`SiteRelay.relay_lost`:
it hears the server and sends it its changes itself); the pieces of that step already back are
its site's mean, the rest its own gradient.
"""

from __future__ import annotations

import math
import queue
import sys
import time
from collections import deque
from collections.abc import Sequence

import torch

from hybridtrain.contract import VALUE_BYTES
from hybridtrain.wiresize import SITE_PIECE, site_value_bytes
from trainer.algorithm import chunks
from trainer.config import TrainConfig
from trainer.flat_model import FlatModel
from trainer.frames import BYE, SITE_MEAN, ProtocolError, SiteGrad, SiteMean, check, expect, pack, unpack
from trainer.membership import relay_wait_s
from trainer.relay import SERVER
from trainer.site_relay import SiteRelay
from trainer.transport import Transport
from trainer.wire import peek_kind

# Elements a piece: 2 MB of bf16, 17 ms at 1 Gbit/s, so the relay's first mean leaves while the
# rest of a large model is still on its way to it; a small model is one piece. The performance
# model sizes the frames with the same constant.
PIECE = SITE_PIECE
# How often a member waiting for its mean looks whether its relay or the server is gone.
POLL_S = 0.05


def site_dtype(value_dtype: str) -> torch.dtype:
    """The in-site exchange's width in a run of `value_dtype` values: bf16, half of fp32's bytes
    with its range (these gradients have no error feedback, and fp16 would flush the small ones
    to zero; the rounding is DDP's bf16 compression hook's), or fp32 in a run that asks for
    exact values (`--value-dtype fp32`)."""
    return torch.float32 if site_value_bytes(VALUE_BYTES[value_dtype]) == 4 else torch.bfloat16


def site_mean(parts: Sequence[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Step 3, eq. 1-2 within a site: sum_m (n_m / sum n) g_m of (samples, gradient) pairs, in
    fp32, summed in the order given (the relay's own first, then its members by rank)."""
    total = sum(n for n, _ in parts)
    if not parts or total <= 0:
        raise ValueError(f"site_mean: need gradients with samples, got {[n for n, _ in parts]}")
    out = torch.zeros(parts[0][1].numel(), dtype=torch.float32)
    for n, g in parts:
        out.add_(g.reshape(-1).float(), alpha=n / total)
    return out


def pieces(numel: int) -> tuple[tuple[int, int], ...]:
    """The (start, stop) ranges of the flat gradient that travel as one frame each."""
    return chunks(numel, max(1, math.ceil(numel / PIECE)))


class SiteReplica:
    """A worker's part in its site's replica, each inner step (`average`): the site's relay
    averages its members' gradients with its own, a member sends its gradient and takes the
    mean, a worker alone in its site (or cut off from it) keeps its own. Who is which is the
    site relay's to say (`SiteRelay.site`, `SiteRelay.up`)."""

    def __init__(self, cfg: TrainConfig, rank: int, transport: Transport, relay: SiteRelay, flat: FlatModel,
                 step_times: deque[float]) -> None:
        self.cfg, self.rank, self.transport, self.relay, self.flat = cfg, rank, transport, relay, flat
        # This worker's recent inner-step times: the relay's wait for a member scales with them.
        self.step_times = step_times
        self.pieces = pieces(flat.layout.numel)
        self.dtype = site_dtype(cfg.value_dtype)
        # The relay's means, kept apart from the server's updates the relay forwards: those go
        # out whenever they arrive (an overlapped outer step's amid inner steps) and must not
        # stand in a mean's way.
        self._means: queue.Queue[torch.Tensor] = queue.Queue()

    def on_frame(self, peer: int, frame: torch.Tensor) -> bool:
        """On the inbox thread: a mean from the site's relay is taken into its own queue (True);
        every other frame is the site relay's to look at (`SiteRelay.on_frame`)."""
        if peer != SERVER and peek_kind(frame) == SITE_MEAN:
            self._means.put(frame)
            return True
        return self.relay.on_frame(peer, frame)

    def average(self, step: int, samples: int) -> float:
        """Steps 1-3 of inner step `step`, this worker's gradient (of `samples` samples) in the
        flat gradient: it becomes the site's mean. Returns the seconds taken (communication)."""
        t0 = time.perf_counter()
        self.relay.admit_joiners(step)
        if self.relay.site:
            self._combine(step, samples)
        elif self.relay.up != SERVER:
            self._exchange(step, samples)
        return time.perf_counter() - t0

    # -- the relay ----------------------------------------------------------------------------
    def _combine(self, step: int, samples: int) -> None:
        grad = self.flat.grad
        wait_s = relay_wait_s(self.step_times, self.cfg.timeout_s)
        posted = []
        for p, (a, b) in enumerate(self.pieces):
            parts = [(samples, grad[a:b].detach().cpu())]
            heard = []
            deadline = time.monotonic() + wait_s
            for m in self.relay.site:
                got = self._member_piece(m, step, p, deadline, wait_s)
                if got is not None:
                    parts.append((got.samples, got.values))
                    heard.append(m)
            mean = site_mean(parts).to(self.dtype)
            grad[a:b].copy_(mean)
            if heard:
                posted.append(self.transport.post_many(heard, pack(SiteMean(step, self.rank, p, mean))))
        for wait in posted:
            wait()

    def _member_piece(self, m: int, step: int, p: int, deadline: float, wait_s: float) -> SiteGrad | None:
        """Member `m`'s piece `p` of `step`; None, and `m` left out from now on, if it is gone,
        leaving, or silent past `deadline`."""
        try:
            raw = self.relay.inbox.get(m, timeout_s=max(0.0, deadline - time.monotonic()))[0]
        except (ConnectionError, TimeoutError, OSError) as exc:
            why = f"silent for {wait_s:.1f} s after this relay's own gradient" if isinstance(exc, TimeoutError) else exc
            print(f"[worker rank {self.rank}] site member {m} lost in step {step} ({why}); the site's replica "
                  "goes on without it", file=sys.stderr, flush=True)
            self.relay.leave_out(m)
            return None
        if peek_kind(raw) == BYE:  # leaving the run (a spot notice)
            self.relay.leave_out(m)
            return None
        got = expect(raw, SiteGrad, step, peer=m)
        if got.piece != p:
            raise ProtocolError(f"relay {self.rank}: expected piece {p} of step {step} from rank {m}, got {got.piece}")
        return got

    # -- a member -----------------------------------------------------------------------------
    def _exchange(self, step: int, samples: int) -> None:
        relay = self.relay.up
        grad = self.flat.grad
        posted = [self.transport.post_many([relay], pack(SiteGrad(step, self.rank, p, samples,
                                                                   grad[a:b].to(self.dtype))))
                  for p, (a, b) in enumerate(self.pieces)]
        for p, (a, b) in enumerate(self.pieces):
            mean = self._mean(relay, step, p)
            if isinstance(mean, BaseException):
                self.relay.relay_lost(relay, mean)
                break
            grad[a:b].copy_(mean.values)
        for wait in posted:
            wait()

    def _mean(self, relay: int, step: int, p: int) -> SiteMean | BaseException:
        """Piece `p` of `step`'s site mean from `relay`, or why it will not come: the relay's
        connection ended or the server dropped it. The server gone ends this worker."""
        inbox = self.relay.inbox
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:
            try:
                raw = self._means.get(timeout=POLL_S)
            except queue.Empty:
                lost = inbox.failed(SERVER)
                if lost is not None:
                    raise lost
                lost = inbox.failed(relay)
                if lost is not None:
                    return lost
                if time.monotonic() > deadline:
                    return TimeoutError(f"no site mean from relay {relay} within {self.cfg.timeout_s:.0f} s (--timeout-s)")
                continue
            mean = unpack(raw)
            if isinstance(mean, SiteMean) and mean.step < step:
                continue  # a relay's late mean of a step this worker had to finish alone
            mean = check(mean, SiteMean, step, peer=relay)
            if mean.piece != p:
                raise ProtocolError(f"rank {self.rank}: expected piece {p} of step {step}'s site mean, got {mean.piece}")
            return mean
