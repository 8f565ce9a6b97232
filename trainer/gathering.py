"""Reading the workers' frames of a round at the parameter server: the next frame of each,
with the silent and the failed dropped (`Departures.lose`) and leavers let go as their BYE
arrives, not when the round's last frame does (a spot notice's grace is short, and the run's
events say when it left). A worker's STATE answering a scheduled checkpoint's FETCH is handed
to the `Checkpointer` as it arrives."""

from __future__ import annotations

import time

import torch

from trainer.checkpointing import Checkpointer
from trainer.config import TrainConfig
from trainer.departures import Departures
from trainer.frames import BYE, STATE, Grad, unpack
from trainer.late_changes import LateChanges
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
    """The rounds' reads, over the run's inbox; losses and leaves go to `departures`. Under
    asynchronous outer steps (`late`, trainer.late_changes) a round's GRADs may close without a
    straggler, whose change is taken whenever it comes."""

    def __init__(self, cfg: TrainConfig, roster: Roster, inbox: Inbox, departures: Departures,
                 checkpoints: Checkpointer, late: LateChanges | None = None) -> None:
        self.cfg, self.roster, self.inbox, self.departures, self.checkpoints = cfg, roster, inbox, departures, checkpoints
        self.late = late

    def collect(self, ranks: list[int], step: int, *, first_s: float) -> dict:
        """The next frame of each of `ranks`, waiting up to `first_s` for the first and the loss
        deadline for the rest; the ones that fail or stay silent are lost (after `step`)."""
        return self.collect_closing(ranks, step, first_s=first_s)[0]

    def collect_closing(self, ranks: list[int], step: int, *, first_s: float,
                        close_s: float | None = None) -> tuple[dict, list[int]]:
        """`collect`, and with `close_s` the rest get that long after the first instead of the
        loss deadline: those silent then are left out of the round (returned second), unless
        silent for the loss deadline since the first round they missed."""
        then = self.roster.loss_deadline_s()
        got: dict = {}
        left_out: list[int] = []
        want = list(ranks)
        closes_at: float | None = None
        consume = self.late.consume if self.late is not None else None
        while want:
            rest = then if close_s is None else close_s if closes_at is None else max(0.0, closes_at - time.monotonic())
            more, early, failed = self.inbox.collect(want, first_s=rest if got else first_s, then_s=rest,
                                                     at_once=_out_of_round, consume=consume)
            if close_s is not None and closes_at is None and more:
                # The clock started at the first frame, at most this call's return ago.
                closes_at = time.monotonic() + (0.0 if _timed_out(failed) else close_s)
            if close_s is not None and (got or more):
                # Silent, not failed, in a round under way: left out of it, its change still to come.
                for w in [w for w, exc in failed.items() if isinstance(exc, TimeoutError)
                          and self.inbox.failed(w) is None]:
                    assert self.late is not None
                    if not self.late.silent_too_long(w, then):
                        del failed[w]
                        left_out.append(w)
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
            want = [w for w in want if w not in got and w not in failed and w not in left_out and w in self.roster]
        # Rank order, whatever the arrival order: sums in floating point must not vary.
        return dict(sorted(got.items())), sorted(left_out)

    def gather_round(self, step: int, *, close_s: float | None = None) -> tuple[dict, dict, list[int]]:
        """The next frame of every worker in the round after `step`: the GRAD senders first; if
        that is not a step, everyone. Returns (the raw frames with their arrival times, the
        frames, the workers left out), in rank order. `close_s`: a step may close that long after
        its first GRAD without the workers silent then (asynchronous outer steps)."""
        first, left_out = self.collect_closing(self.roster.senders(), step, first_s=self.cfg.timeout_s,
                                               close_s=close_s)
        frames = {w: unpack(raw) for w, (raw, _) in first.items()}
        frames = self.departures.let_leavers_go(frames, step)
        if frames and not all(isinstance(f, Grad) for f in frames.values()):
            left_out = []
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
        return first, dict(sorted(frames.items())), [w for w in left_out if w in self.roster]


def _timed_out(failed: dict) -> bool:
    """Whether a collect returned at its deadline (a TimeoutError among its failures)."""
    return any(isinstance(exc, TimeoutError) for exc in failed.values())
