"""Workers leaving a parameter-server run between or during its rounds (docs/elastic.md):

1. A worker is lost when its connection ends (a killed process: end-of-file) or when it sends
   nothing for `Roster.loss_deadline_s()` after its peers' frames of a round (a silent node, a
   link down). It is dropped, the batch is split over the others, and the next update carries
   the new shares; what its error-feedback residual held is gone.
2. A worker that leaves (BYE with `leaving`, on SIGTERM) is let go the same way, and told BYE.
3. A dropped relay's site workers hear the server directly from then on (a ROUTE), and get the
   latest step's update again in case the relay did not pass it on. Under per-site aggregation
   the server also keeps, per worker, the last (step, chunk) its frames brought (a relay's
   carries its site's gradients); for a lost relay's site, what each worker sends again itself
   up to there is dropped, the rest is its own frames from then on.
"""

from __future__ import annotations

import torch

from hybridtrain.contract import EVENT_WORKER_LEFT, EVENT_WORKER_LOST
from trainer.checkpointing import Checkpointer
from trainer.config import TrainConfig
from trainer.frames import GRAD, SERVER, Bye, ProtocolError, pack, unpack
from trainer.membership import Roster, reroute
from trainer.metrics import MetricsLogger
from trainer.ps_log import say
from trainer.transport import Inbox, Transport
from trainer.wire import peek_kind

RESIDUAL_GONE = "its error-feedback residual (the part of its gradient not sent yet) is gone"

# A worker its site's relay left out of the site's frame is read this long for a BYE it sent
# on leaving (it says so to the server before its relay) before it counts as lost.
LEAVE_GRACE_S = 2.0


class Departures:
    """Drops lost and leaving workers from the roster and re-routes whom they relayed to; keeps
    who has gone, the latest step's update frames, and the per-site relays' ledger."""

    def __init__(self, cfg: TrainConfig, roster: Roster, transport: Transport, inbox: Inbox,
                 metrics: MetricsLogger, checkpoints: Checkpointer) -> None:
        self.cfg, self.roster, self.transport, self.inbox = cfg, roster, transport, inbox
        self.metrics, self.checkpoints = metrics, checkpoints
        self.elastic = hasattr(transport, "arrivals")
        self.gone: set[int] = set()
        # The latest step's update frames, sent again to a lost relay's workers.
        self.last_updates: list[torch.Tensor] = []
        # Per-site aggregation: the last (step, chunk) each worker's frame brought, and for a lost
        # relay's workers, the last (step, chunk) that reached the server through the relay.
        self.relayed: dict[int, tuple[int, int]] = {}
        self.covered: dict[int, tuple[int, int]] = {}

    # -- what the rounds tell it ----------------------------------------------------------------------
    def new_step(self) -> None:
        """A step's rounds begin: its updates replace the last step's."""
        self.last_updates = []

    def sent(self, frame: torch.Tensor) -> None:
        """One chunk's update frame of the step went out."""
        self.last_updates.append(frame)

    def passed_on(self, senders: list[int], step: int, chunk: int) -> None:
        """Per-site aggregation: `senders`' frames (a relay's with its site's) brought `chunk` of `step`."""
        for w in senders:
            self.relayed[w] = (step, chunk)

    def owing(self, step: int, chunk: int, have: dict) -> list[int]:
        """A lost relay's workers not in `have` that send `chunk` of `step` themselves, as the
        relay had not passed it on."""
        return [w for w, upto in self.covered.items()
                if w in self.roster and w not in have and upto < (step, chunk)]

    def came_through_relay(self, rank: int, raw: torch.Tensor) -> bool:
        """Whether `raw` is a gradient chunk of a lost relay's worker that the relay passed on already."""
        if rank not in self.covered or peek_kind(raw) != GRAD:
            return False
        frame = unpack(raw)
        return (frame.step, frame.chunk) <= self.covered[rank]

    def returns(self, rank: int) -> None:
        """A worker of this rank is admitted again."""
        self.gone.discard(rank)

    # -- losses and leaves ------------------------------------------------------------------------------
    def lose(self, rank: int, exc: BaseException, step: int, *, why: str | None = None) -> None:
        """Drop a worker whose connection ended or that stayed silent; the others train on."""
        if rank not in self.roster:
            return
        silent = isinstance(exc, TimeoutError)
        why = why or (f"silent for {self.roster.loss_deadline_s():.1f} s after its peers' frames" if silent
                      else f"its connection ended ({exc})")
        self._drop(rank, step, f"worker {rank} lost at step {step}: {why}")
        self.metrics.event(step, EVENT_WORKER_LOST, subject=rank,
                           detail=f"{why}; {self._what_is_gone(step)}; the batch is split over "
                                  f"{len(self.roster)} workers")
        if self.elastic:
            self.transport.forget(rank)

    def leave(self, rank: int, step: int) -> None:
        """Let a worker go that said it is leaving (a spot notice); it gets BYE."""
        self._drop(rank, step, f"worker {rank} left at step {step}")
        self.metrics.event(step, EVENT_WORKER_LEFT, subject=rank,
                           detail=f"left cleanly after step {step}; {self._what_is_gone(step)}; the batch is "
                                  f"split over {len(self.roster)} workers")
        try:
            self.transport.send(rank, pack(Bye(step, SERVER)))
        except (ConnectionError, OSError):
            pass

    def let_leavers_go(self, frames: dict, step: int) -> dict:
        """`frames` without the leavers' BYEs, each leaver let go."""
        out = {}
        for w, f in frames.items():
            if isinstance(f, Bye) and f.leaving:
                self.leave(w, step)
            else:
                out[w] = f
        return out

    def drop_failed(self, step: int) -> None:
        """Drop the workers whose connection has ended since the last look."""
        for w in self.roster.ranks():
            exc = self.inbox.failed(w)
            if exc is not None:
                self.lose(w, exc, step)

    def require_a_worker(self, step: int) -> None:
        """Fail the run when no worker that computes is left."""
        # A joiner still catching up holds only the state of a step the run cannot finish.
        if not self.roster.active():
            raise ProtocolError(f"every worker has left or been lost at step {step}: no live worker holds "
                                "the model; the run restarts from its latest checkpoint")

    def settle_site(self, relay: int, combined: tuple[int, ...], step: int) -> None:
        """A relay's site frame combined `combined`: a worker of its site left out was lost or
        left on the way (the relay waits only so long), and is dropped or let go now."""
        for m in self.roster.forwards(relay):
            if m in combined or self.roster.members[m].joining:
                continue
            try:
                item = self.inbox.get(m, timeout_s=LEAVE_GRACE_S)
            except TimeoutError:
                item = None
            except (ConnectionError, OSError) as exc:
                self.lose(m, exc, step)
                continue
            if item is not None:
                frame = unpack(item[0])
                if isinstance(frame, Bye) and frame.leaving:
                    self.leave(m, step)
                    continue
                self.inbox.unget(m, item)
            self.lose(m, TimeoutError(), step, why=f"its site's relay {relay} went on without it")

    def _what_is_gone(self, step: int) -> str:
        """What a worker that leaves or is lost takes with it."""
        if not self.cfg.is_local_sgd:
            return RESIDUAL_GONE
        # Under local SGD a worker that goes between outer steps takes its inner steps with it:
        # the next outer step averages the others' changes only.
        return (f"its inner steps since the outer step of step {step} are dropped (never averaged)"
                + (f" and {RESIDUAL_GONE}" if self.cfg.compresses else ""))

    def _drop(self, rank: int, step: int, what: str) -> None:
        self.checkpoints.lost(rank)
        relay = self.roster.source(rank)
        orphans = self.roster.remove(rank)
        self.gone.add(rank)
        self.covered.pop(rank, None)
        upto = self.relayed.pop(rank, (-1, -1))
        if relay != SERVER and relay in self.roster:
            # Its relay stops forwarding to it (and trying to connect to a peer that is gone);
            # under per-site aggregation it stops waiting for its gradients too.
            reroute(self.transport, self.roster, relay, step)
        self.roster.resplit()
        say(f"{what}; training on with {len(self.roster)} workers, batch shares "
            f"{[n for n in self.roster.batch_sizes if n]}")
        for w in orphans:
            if self.cfg.combines_at_sites:
                # Its gradients went up through the relay: what reached the server counts once,
                # and it sends the rest again itself (PSClient keeps them until applied).
                self.covered[w] = upto
            # It hears the server from now on, without waiting out a relay that went silent.
            reroute(self.transport, self.roster, w, step, source=SERVER)
            # Whatever of the latest step the relay may not have passed on goes to it again
            # (it skips what it already has).
            for frame in self.last_updates:
                self.transport.send(w, frame)
