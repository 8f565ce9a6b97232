"""Reading the workers' frames of a round at the parameter server: the next frame of each,
with the silent and the failed dropped (`Departures.lose`) and leavers let go as their BYE
arrives, not when the round's last frame does (a spot notice's grace is short, and the run's
events say when it left). A worker's STATE answering a scheduled checkpoint's FETCH is handed
to the `Checkpointer` as it arrives."""

from __future__ import annotations

import torch

from trainer.checkpointing import Checkpointer
from trainer.config import TrainConfig
from trainer.departures import Departures
from trainer.frames import BYE, STATE, Grad, unpack
from trainer.membership import Roster
from trainer.transport import Inbox
from trainer.wire import peek_kind


def _is_leaving(raw: torch.Tensor) -> bool:
    """Whether `raw` is a worker's BYE leaving a run that goes on (a spot notice)."""
    return peek_kind(raw) == BYE and unpack(raw).leaving


def _out_of_round(raw: torch.Tensor) -> bool:
    """Whether `raw` is handled as it arrives, outside the round: a leaver's BYE, or a worker's
    STATE answering a scheduled checkpoint's FETCH."""
    return peek_kind(raw) == STATE or _is_leaving(raw)


class Gatherer:
    """The rounds' reads, over the run's inbox; losses and leaves go to `departures`."""

    def __init__(self, cfg: TrainConfig, roster: Roster, inbox: Inbox, departures: Departures,
                 checkpoints: Checkpointer) -> None:
        self.cfg, self.roster, self.inbox, self.departures, self.checkpoints = cfg, roster, inbox, departures, checkpoints

    def collect(self, ranks: list[int], step: int, *, first_s: float) -> dict:
        """The next frame of each of `ranks`, waiting up to `first_s` for the first and the loss
        deadline for the rest; the ones that fail or stay silent are lost (after `step`)."""
        then = self.roster.loss_deadline_s()
        got: dict = {}
        want = list(ranks)
        while want:
            more, early, failed = self.inbox.collect(want, first_s=then if got else first_s, then_s=then,
                                                     at_once=_out_of_round)
            # Losses first: a relay's loss says which of its workers' frames came through it.
            for w, exc in failed.items():
                self.departures.lose(w, exc, step)
            for w in [w for w in more if self.departures.came_through_relay(w, more[w][0])]:
                del more[w]
            for w, (raw, _) in early.items():
                if peek_kind(raw) == STATE:
                    self.checkpoints.answer(w, unpack(raw))
                else:
                    self.departures.leave(w, step)
            got.update(more)
            want = [w for w in want if w not in got and w not in failed and w in self.roster]
        # Rank order, whatever the arrival order: sums in floating point must not vary.
        return dict(sorted(got.items()))

    def gather_round(self, step: int) -> tuple[dict, dict]:
        """The next frame of every worker in the round after `step`: the GRAD senders first; if
        that is not a step, everyone. Returns (the raw frames with their arrival times, the
        frames), in rank order."""
        first = self.collect(self.roster.senders(), step, first_s=self.cfg.timeout_s)
        frames = {w: unpack(raw) for w, (raw, _) in first.items()}
        frames = self.departures.let_leavers_go(frames, step)
        if frames and not all(isinstance(f, Grad) for f in frames.values()):
            # Not a step: every worker takes part (an evaluation, the goodbye).
            rest = [w for w in self.roster.active() if w not in first and w not in self.departures.gone]
            # The round is under way (its first frames are in): the rest (under per-site
            # aggregation, the relays' site workers) are held to the loss deadline too.
            more = self.collect(rest, step, first_s=self.roster.loss_deadline_s())
            first.update(more)
            frames.update(self.departures.let_leavers_go({w: unpack(raw) for w, (raw, _) in more.items()}, step))
            # A worker admitted just before an evaluation starts at the step after it: its
            # gradient waits until the others have evaluated the step it did not train.
            done = {f.step for f in frames.values() if not isinstance(f, Grad) and hasattr(f, "step")}
            for w in [w for w, f in frames.items() if isinstance(f, Grad) and done and f.step > max(done)]:
                self.inbox.unget(w, first.pop(w))
                del frames[w]
        first = {w: v for w, v in sorted(first.items()) if w in frames}
        return first, dict(sorted(frames.items()))
