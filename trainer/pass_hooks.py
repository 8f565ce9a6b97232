"""`--apply-in-forward`, a helper `trainer.ps.PSClient` holds: step() applies the update's first
chunk (the dense part and the next step's batch split ride with it) and returns; a forward
pre-hook on every module holding compressed parameters applies the pending chunks up to the
last one they lie in, just before the module runs, as plain SGD (momentum correction's rule),
so the rest of the reply's way back overlaps the next forward pass with nothing stale.

docs/trainer.md, step 11, says what it costs and when it pays (the intercontinental testbed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from torch import nn

from trainer.frames import Update
from trainer.server_link import ServerLink
from trainer.sgd_rules import hyperparameter_values
from trainer.updates import UpdateApplier

log = logging.getLogger("trainer.ps")


class ApplyInForward:
    """The update still pending (its step, from which chunk on) and the hooks that apply it."""

    def __init__(self, model: nn.Module, optimizer, applier: UpdateApplier, link: ServerLink,
                 take: Callable[[Update, list[dict] | None], None], done: Callable[[int], None]) -> None:
        self.optimizer, self.applier, self.link, self._take, self._done = optimizer, applier, link, take, done
        self.chunks = len(applier.bounds)
        self.pending: int | None = None
        self.next_chunk = 0
        # The optimizer's settings at the pending update's own step: a schedule may have
        # stepped them since, and the update must move the weights with its step's rate.
        self.hyper: list[dict] | None = None
        # How long the forward pass waited for chunks still on the way: communication, not
        # compute, for re-balancing.
        self.blocked_s = 0.0
        self._hook_modules(model)

    @staticmethod
    def wanted(asked: bool, applier: UpdateApplier) -> bool:
        """The run asks for it and this worker can: updates applied in place, chunk by chunk."""
        if not asked:
            return False
        if applier.velocity is None:
            log.warning("apply-in-forward needs an SGD optimizer with momentum under momentum correction; "
                        "this worker applies each update whole at step()")
            return False
        if applier.pieces is None:
            log.warning("apply-in-forward needs contiguous parameters (not channels_last); this worker applies "
                        "each update whole at step()")
            return False
        return True

    def _hook_modules(self, model: nn.Module) -> None:
        """A forward pre-hook on every module holding compressed parameters directly applies the
        pending chunks up to the last one they lie in; the model's own forward hook applies the
        rest when it ends (parameters the pass did not read, before the loss or anything after)."""
        last: dict[nn.Parameter, int] = {}
        for c, pieces in enumerate(self.applier.pieces):
            for piece in pieces:
                last[piece[0]] = c
        for module in model.modules():
            need = [last[p] for p in module.parameters(recurse=False) if p in last]
            if need:
                module.register_forward_pre_hook(partial(self._before_forward, max(need)))
        model.register_forward_hook(self._after_forward, always_call=True)

    def _before_forward(self, need: int, module: nn.Module, args: tuple) -> None:
        if self.pending is not None and self.next_chunk <= need and not self.link.ended:
            self.blocked_s += self.pull_through(need)

    def _after_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.pending is not None and not self.link.ended:
            self.blocked_s += self.pull_through(self.chunks - 1)

    def hold(self, step: int) -> None:
        """`step`'s update is the pending one: apply its first chunk now, the rest in the hooks."""
        self.pending, self.hyper, self.next_chunk = step, hyperparameter_values(self.optimizer), 0
        self.pull_through(0)

    def drain(self) -> None:
        """Apply whatever of the pending update is not applied yet."""
        if self.pending is not None and not self.link.ended:
            self.pull_through(self.chunks - 1)

    def pull_through(self, upto: int) -> float:
        """Apply the pending update's chunks through `upto` as they arrive; the seconds it took."""
        t0 = time.perf_counter()
        self.link.read_update(self.pending, self._take_one, start=self.next_chunk, stop=upto + 1)
        return time.perf_counter() - t0

    def _take_one(self, update: Update) -> None:
        self._take(update, self.hyper)
        self.next_chunk = update.chunk + 1
        if self.next_chunk == self.chunks:
            self.pending = self.hyper = None
            self._done(update.step)
