"""How a worker applies an update under momentum correction, a mixin of `trainer.ps.PSClient`:
the compressed tensors take plain SGD there (their momentum travels in the velocity), so each
chunk of the server's update goes straight into the parameters it spans, touching its own
elements only, as it arrives. `step()` applies a whole update this way, and apply-in-forward's
forward pre-hooks (`trainer.pass_hooks`) one chunk at a time. Without momentum correction, or
with a non-contiguous parameter, the update goes through the flat gradient and the optimizer's
own step (`PSClient.apply`)."""

from __future__ import annotations

import torch
from torch import nn

from trainer.algorithm import add_payload, chunk_pieces
from trainer.frames import Update
from trainer.sgd_rules import hyperparameter_values, hyperparameters


class InPlaceUpdates:
    """Each chunk of an update into the parameters it spans (`PSClient.apply`'s path under
    momentum correction)."""

    def _applies_in_place(self) -> bool:
        """Whether this worker's compressed tensors take plain SGD (their momentum is in the
        velocity) and are contiguous, so each chunk's share of one is applied on its own."""
        return self.velocity is not None and all(p.is_contiguous() for p in self._compressed)

    def _chunk_pieces(self) -> list[list[tuple[nn.Parameter, int, int, int, int, int]]]:
        """`algorithm.chunk_pieces` with each parameter and its optimizer group (a parameter
        outside the optimizer never moves, so it has no piece)."""
        group_of = {p: g for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        return [[(self._params[name], *span, group_of[self._params[name]]) for name, *span in pieces
                 if self._params[name] in group_of] for pieces in chunk_pieces(self.layout, self.bounds)]

    def _apply_in_place(self, update: Update) -> None:
        """One chunk of an update straight into the parameters it holds, as plain SGD (momentum
        correction's rule for the compressed tensors), its elements only. The dense chunk also
        brings the dense tensors' optimizer step; the chunk carrying the next batch split (the
        last, or under apply-in-forward the first) sets it, and the last the next densities."""
        c = update.chunk
        lrs = [g["lr"] for g in (self._applying_hyper or hyperparameter_values(self.optimizer))]
        with torch.no_grad():
            add_payload([(p.view(-1), first, end, s, e, -lrs[g]) for p, first, end, s, e, g in self._pieces[c]],
                        update.sparse)
        if c == self.dense_chunk:
            nd = self.layout.dense_numel
            # After zero_grad() the buffer holds the next gradient (zeros before backward).
            held = self.flat_grad[:nd].clone() if self._sending is not None else None
            self.flat_grad[:nd].copy_(update.dense.values.to(self.device, torch.float32))
            try:
                with hyperparameters(self.optimizer, self._applying_hyper):
                    self._step_dense()
            finally:
                if held is not None:
                    self.flat_grad[:nd].copy_(held)
        if update.batch_sizes:
            self.batch_sizes = list(update.batch_sizes)
        if c == len(self.bounds) - 1:
            self.densities = list(update.densities)
        if self._in_forward and self._pending is not None:
            self._pending_chunk = c + 1
            if self._pending_chunk == len(self.bounds):
                self.step, self._pending, self._pending_hyper = update.step, None, None
