"""How a worker applies the server's update (seed 000, step 4), a helper `trainer.ps.PSClient`
holds. Every worker applies the same update with its own optimizer, so the replicas stay equal.

Under momentum correction the compressed tensors take plain SGD (their momentum travels in the
velocity), so each chunk goes straight into the parameters it spans, touching its own elements
only, as it arrives: a third to a half less time than through the flat gradient and one pass
over the whole model on the step's tail (bench/compression.py). Without momentum correction,
or with a non-contiguous parameter, or under local SGD (whose update is the mean pseudo-
gradient, applied by the outer step), a chunk goes into the flat gradient and, after the last,
the optimizer steps once.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.algorithm import add_payload, apply_payload, chunk_pieces
from trainer.codec_state import DENSE_CHUNK
from trainer.flat_model import FlatModel
from trainer.frames import Update
from trainer.sgd_rules import hyperparameter_values, hyperparameters, sgd_step

Piece = tuple[nn.Parameter, int, int, int, int, int]


class UpdateApplier:
    """Apply an update chunk by chunk; `apply` says when the step's update is complete."""

    def __init__(self, flat: FlatModel, optimizer: torch.optim.Optimizer, bounds: tuple[tuple[int, int], ...],
                 *, velocity: torch.Tensor | None, outer: bool) -> None:
        self.flat, self.optimizer, self.bounds = flat, optimizer, bounds
        self.velocity, self.outer = velocity, outer
        self.pieces = self._chunk_pieces() if self.in_place else None

    @property
    def in_place(self) -> bool:
        """Whether the compressed tensors take plain SGD (their momentum is in the velocity) and
        are contiguous, so each chunk's share of one is applied on its own."""
        return (not self.outer and self.velocity is not None
                and all(p.is_contiguous() for p in self.flat.compressed))

    def _chunk_pieces(self) -> list[list[Piece]]:
        """`algorithm.chunk_pieces` with each parameter and its optimizer group (a parameter
        outside the optimizer never moves, so it has no piece)."""
        params = self.flat.params
        group_of = {p: g for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        return [[(params[name], *span, group_of[params[name]]) for name, *span in pieces
                 if params[name] in group_of] for pieces in chunk_pieces(self.flat.layout, self.bounds)]

    def apply(self, update: Update, hyper: list[dict] | None = None, *, last: int | None = None) -> bool:
        """One chunk of `update`, with the optimizer's settings `hyper` (None: as they are now);
        True once its last chunk (`last`, default the model's last; streaming local SGD's round
        ends with its last fragment) is in. Under local SGD the flat gradient then holds the
        workers' mean pseudo-gradient, for the outer step."""
        last = len(self.bounds) - 1 if last is None else last
        if self.pieces is not None:
            self._apply_in_place(update, hyper)
        else:
            nd = self.flat.layout.dense_numel
            grad = self.flat.grad
            if update.chunk == DENSE_CHUNK:
                grad[:nd].copy_(update.dense.values.to(grad.device, torch.float32))
            a, b = self.bounds[update.chunk]
            apply_payload(grad[nd + a : nd + b], update.sparse)
            if update.chunk == last and not self.outer:
                with hyperparameters(self.optimizer, hyper):
                    if self.velocity is None:
                        self.optimizer.step()
                    else:  # momentum correction on a non-contiguous tensor
                        sgd_step(self.optimizer, self.flat.compressed)
                        self._step_dense()
        return update.chunk == last

    def _apply_in_place(self, update: Update, hyper: list[dict] | None) -> None:
        """One chunk straight into the parameters it holds, as plain SGD, its elements only; the
        dense chunk also brings the dense tensors' optimizer step."""
        c = update.chunk
        lrs = [g["lr"] for g in (hyper or hyperparameter_values(self.optimizer))]
        with torch.no_grad():
            add_payload([(p.view(-1), first, end, s, e, -lrs[g]) for p, first, end, s, e, g in self.pieces[c]],
                        update.sparse)
        if c == DENSE_CHUNK:
            nd = self.flat.layout.dense_numel
            self.flat.grad[:nd].copy_(update.dense.values.to(self.flat.grad.device, torch.float32))
            with hyperparameters(self.optimizer, hyper):
                self._step_dense()

    def _step_dense(self) -> None:
        """The optimizer's step on the dense tensors alone: the compressed ones have had theirs
        (plain SGD under momentum correction), so they go without a gradient, which SGD skips."""
        for p in self.flat.compressed:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            self.flat.bind()

