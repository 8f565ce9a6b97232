"""Asynchronous outer steps at the parameter server (`--async-outer`): a round closes without
its stragglers, and a straggler's change joins a later round's mean instead.

1. A round's first change starts a short clock (`round_deadline_s`); the changes in by then are
   the round's, averaged by their samples as ever (eq. 1-2). The workers still silent are left
   out of it (deferred), not lost: their change is on its way.
2. A change that comes after its round closed (a GRAD of a step the server has answered) is
   taken as it arrives, chunk by chunk, out of whatever round the server is reading
   (`LateChanges.consume`).
3. The next round's mean takes every late change whose chunks are all in, weighted by
   samples / (1 + rounds late) (`fold_weight`); one more than MAX_ROUNDS_LATE rounds late is
   dropped. Every worker applies the same means in the same order, so the common parameters
   stay one model; the server logs each round's `outer_deferred`, `outer_folded` and
   `outer_dropped`.

docs/trainer.md ("Asynchronous outer steps") says why these choices.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

import torch

from trainer.frames import GRAD, Grad, unpack
from trainer.wire import peek_head

# The round's deadline: this share of the workers' inner compute per round (their median, as the
# last round's frames reported it), with a floor against scheduling noise, and at most half the
# loss deadline so that a late worker is deferred long before it could be called lost.
DEADLINE_SHARE = 0.25
DEADLINE_FLOOR_S = 0.25
# A change may join the mean at most this many rounds after its own; later ones are dropped.
MAX_ROUNDS_LATE = 1


def round_deadline_s(compute_s: float | None, loss_deadline_s: float) -> float:
    """How long after a round's first change the server waits for the others' (None: no round
    has reported its compute yet, so half the loss deadline)."""
    if compute_s is None:
        return loss_deadline_s / 2
    return min(max(DEADLINE_FLOOR_S, DEADLINE_SHARE * compute_s), loss_deadline_s / 2)


def fold_weight(samples: float, rounds_late: int, *, bound: int = MAX_ROUNDS_LATE) -> float | None:
    """A late change's weight in the mean it joins, samples / (1 + rounds late); None when it is
    later than `bound` rounds (dropped)."""
    if rounds_late > bound:
        return None
    return samples / (1 + rounds_late)


@dataclass
class Fold:
    """What one round takes from the late changes: per chunk the frames and their weights, and
    the last chunks of every late change settled (folded or dropped), whose timings the planner reads."""

    chunks: dict[int, list[tuple[Grad, float]]] = field(default_factory=dict)
    folded: int = 0
    dropped: int = 0
    samples: int = 0  # the folded changes' own samples (the round's throughput counts them)
    seen: list[Grad] = field(default_factory=list)

    def grads(self, chunk: int) -> list[tuple[Grad, float]]:
        """The late frames of `chunk` this round's mean takes, with their weights."""
        return self.chunks.get(chunk, [])


class LateChanges:
    """The server's record of which rounds closed when, the late changes' chunks as they arrive,
    and who has been silent since the first round it missed."""

    def __init__(self, chunks: Callable[[], int], *, bound: int = MAX_ROUNDS_LATE) -> None:
        self._chunks, self.bound = chunks, bound
        self.rounds = 0  # outer rounds closed
        self.last_step = -1  # the step of the last round closed: a GRAD of it or before is late
        self.round_of: dict[int, int] = {}  # a closed round's step -> its number
        self.parts: dict[tuple[int, int], dict[int, Grad]] = {}  # (rank, step) -> chunk -> frame
        self.missed_since: dict[int, float] = {}  # rank -> when the first round it missed closed
        self.compute_s: float | None = None
        self.taking: Fold | None = None  # what the round under way takes (`fold`)

    def deadline_s(self, loss_deadline_s: float) -> float:
        """This round's deadline (`round_deadline_s` of the last round's compute)."""
        return round_deadline_s(self.compute_s, loss_deadline_s)

    def consume(self, peer: int, raw: torch.Tensor) -> bool:
        """Take `raw` if it is a late change's chunk (True); any frame means `peer` is heard."""
        self.missed_since.pop(peer, None)
        kind, step, _ = peek_head(raw)
        if kind != GRAD or step > self.last_step:
            return False
        grad = unpack(raw)
        assert isinstance(grad, Grad)
        self.parts.setdefault((peer, step), {})[grad.chunk] = grad
        return True

    def silent_too_long(self, rank: int, loss_deadline_s: float) -> bool:
        """Whether `rank`, left out again, has sent nothing for the loss deadline since the first
        round it missed closed: then it is lost, as a silent worker of a synchronous round is."""
        since = self.missed_since.get(rank)
        return since is not None and time.monotonic() - since > loss_deadline_s

    def fold(self, members: Container[int]) -> Fold:
        """The late changes the next round's mean takes: those whose chunks are all in, weighted by
        `fold_weight`; those beyond the bound, and the unfinished ones of workers no longer in
        `members`, are dropped. The rest wait for a later round. Kept as `taking` until the round
        is `closed`."""
        fold, number, chunks = Fold(), self.rounds + 1, self._chunks()
        # A worker gone (or gone and back under the same rank) starts its silence clock afresh.
        for rank in [r for r in self.missed_since if r not in members]:
            del self.missed_since[rank]
        for (rank, step), parts in sorted(self.parts.items()):
            own = self.round_of.get(step)
            late = None if own is None else number - own
            complete = len(parts) == chunks
            if not complete and rank in members and late is not None and late <= self.bound:
                continue  # its other chunks are on their way
            del self.parts[(rank, step)]
            weight = fold_weight(parts[0].samples, late, bound=self.bound) if complete and late is not None else None
            if weight is None or weight <= 0:
                fold.dropped += 1
            else:
                fold.folded += 1
                fold.samples += parts[0].samples
                for chunk, grad in parts.items():
                    fold.chunks.setdefault(chunk, []).append((grad, weight))
            if chunks - 1 in parts:
                fold.seen.append(parts[chunks - 1])
        self.taking = fold
        return fold

    def closed(self, step: int, grads: Sequence[Grad], left_out: Sequence[int]) -> None:
        """Round `step` is answered with `grads`' changes (their compute times set the next
        deadline); `left_out` missed it."""
        self.rounds += 1
        self.last_step = step
        self.taking = None
        self.round_of[step] = self.rounds
        # Rounds beyond the bound drop whatever comes for them: their number is not needed.
        for old in [s for s, n in self.round_of.items() if n < self.rounds - self.bound - 1]:
            del self.round_of[old]
        for rank in left_out:
            self.missed_since.setdefault(rank, time.monotonic())
        if grads:
            self.compute_s = statistics.median(g.compute_s for g in grads)
