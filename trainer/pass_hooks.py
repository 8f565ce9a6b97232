"""The hooks that move a parameter-server step's communication into the model's own passes, a
mixin of `trainer.ps.PSClient` (whose state they work on: the flat gradient, the chunks'
bounds, the step being sent and the update pending).

- `--overlap`: a post-accumulate-grad hook on every compressed parameter sends each chunk as
  soon as the backward pass has produced all of its gradients (`OverlapHooks`).
- `--apply-in-forward`: step() applies the update's first chunk; a forward pre-hook on every
  module holding compressed parameters applies the pending chunks up to the last one they lie
  in, just before the module runs, as plain SGD (momentum correction's rule), so the rest of
  the reply's way back overlaps the next forward pass (`ApplyInForward`).

docs/trainer.md, steps 8 and 11, says what each costs.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial

import torch
from torch import nn

from trainer.algorithm import chunk_pieces

log = logging.getLogger("trainer.ps")


class OverlapHooks:
    """--overlap: chunks leave from the backward pass (PSClient registers `_on_grad`)."""

    def _params_by_chunk(self) -> list[set[nn.Parameter]]:
        """For each chunk of the compressed part, the parameters whose elements it holds."""
        return [{self._params[name] for name, *_ in pieces} for pieces in chunk_pieces(self.layout, self.bounds)]

    def _chunk_params_names(self) -> list[str]:
        nd = self.layout.dense_numel
        return [n for n, off in zip(self.layout.names, self.layout.offsets) if off >= nd]

    def _on_grad(self, p: nn.Parameter) -> None:
        """The backward pass has produced `p`'s gradient: send every chunk now complete (in
        order; the last chunk waits for step(), which has the loss and the dense part)."""
        sending = self._sending
        if sending is None:
            return
        if p in sending.ready:
            raise RuntimeError("--overlap sends each gradient as soon as the backward pass produces it: "
                               "a second backward before step() (gradient accumulation) is not supported")
        base, end = self.flat_grad.data_ptr(), self.flat_grad.data_ptr() + self.flat_grad.nbytes
        if p.grad is None or not base <= p.grad.data_ptr() < end:
            raise RuntimeError("--overlap needs each parameter's .grad to stay the view the optimizer "
                               "wrapper gave it: call the wrapper's zero_grad(), not the model's")
        decay = self.rules.decay_of.get(p, 0.0)
        if decay:
            with torch.no_grad():
                p.grad.add_(p, alpha=decay)
        sending.ready.add(p)
        last = len(self.bounds) - 1
        while sending.next_chunk < last and self._chunk_params[sending.next_chunk] <= sending.ready:
            self._send_chunk(sending, sending.next_chunk, math.nan, 0.0)


class ApplyInForward:
    """--apply-in-forward: the pending update's chunks applied by forward pre-hooks."""

    def _applies_in_forward(self) -> bool:
        """The run asks for it and this worker can (`_applies_in_place`)."""
        if not self.cfg.applies_in_forward:
            return False
        if self.velocity is None:
            log.warning("apply-in-forward needs an SGD optimizer with momentum under momentum correction; "
                        "this worker applies each update whole at step()")
            return False
        if self._pieces is None:
            log.warning("apply-in-forward needs contiguous parameters (not channels_last); this worker applies "
                        "each update whole at step()")
            return False
        return True

    def _hook_modules(self) -> None:
        """A forward pre-hook on every module holding compressed parameters directly applies the
        pending chunks up to the last one they lie in; the model's own forward hook applies the
        rest when it ends (parameters the pass did not read, before the loss or anything after)."""
        last: dict[nn.Parameter, int] = {}
        for c, pieces in enumerate(self._pieces):
            for piece in pieces:
                last[piece[0]] = c
        for module in self.model.modules():
            need = [last[p] for p in module.parameters(recurse=False) if p in last]
            if need:
                module.register_forward_pre_hook(partial(self._before_forward, max(need)))
        self.model.register_forward_hook(self._after_forward, always_call=True)

    def _before_forward(self, need: int, module: nn.Module, args: tuple) -> None:
        if self._pending is not None and self._pending_chunk <= need and not self.ended_by_server:
            self._blocked_s += self._pull_through(need)

    def _after_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._pending is not None and not self.ended_by_server:
            self._blocked_s += self._pull_through(len(self.bounds) - 1)

    def _pull_through(self, upto: int) -> float:
        """Apply the pending update's chunks through `upto` as they arrive, with the optimizer's
        hyperparameters of the update's own step (a schedule may have stepped since); returns
        the seconds it took."""
        t0 = time.perf_counter()
        self._applying_hyper = self._pending_hyper
        try:
            self._read_updates(self._pending, start=self._pending_chunk, stop=upto + 1)
        finally:
            self._applying_hyper = None
        return time.perf_counter() - t0
