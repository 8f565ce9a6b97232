"""The parameter server's step 3 for one chunk (eq. 1-2, then the server's own compression):
the workers' gradients summed with their sample weights and re-sparsified, each chunk with its
own error-feedback residual. The server never holds the model, only the layout's sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer.algorithm import aggregate_sparsified, chunk_count, chunks
from trainer.codec_state import DENSE_CHUNK, codec, join_residuals, sends_dense, split_residual
from trainer.compression import CompressionState, Payload
from trainer.config import TrainConfig
from trainer.frames import Grad, LayoutSpec


class Aggregator:
    """Each chunk's bounds in the sparse part and its `CompressionState` (the server's residual)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.codec = codec(cfg, "topk")
        self.dense_numel = 0
        self.bounds: tuple[tuple[int, int], ...] = ()
        self.states: list[CompressionState] = []

    def configure(self, layout: LayoutSpec) -> None:
        """Size the chunks for the workers' model: each keeps k_s * its share of the elements."""
        self.dense_numel = layout.dense_numel
        self.bounds = chunks(layout.sparse_numel, chunk_count(layout.sparse_numel, self.cfg.exchange_chunks))
        self.states = [CompressionState(density=self.cfg.densities[3], seed=self.cfg.seed) for _ in self.bounds]

    @property
    def chunks(self) -> int:
        """How many chunks a step's frames come in."""
        return len(self.bounds)

    def combine(self, step: int, chunk: int, grads: list[Grad],
                weights: Sequence[float] | None = None) -> tuple[torch.Tensor, Payload]:
        """The chunk's weighted sum, dense part (on its chunk) and re-sparsified sparse part;
        `weights` replace the frames' samples (late changes folded in)."""
        a, b = self.bounds[chunk]
        state = self.states[chunk]
        state.step = step
        dense_numel = self.dense_numel if chunk == DENSE_CHUNK else 0
        return aggregate_sparsified(grads, dense_numel, b - a, codec=self.codec, state=state,
                                    dense_step=sends_dense(self.cfg, step), weights=weights)

    def residual(self) -> torch.Tensor | None:
        """The chunks' residuals as one flat tensor, a snapshot that later rounds leave alone."""
        residual = join_residuals(self.states)
        # One chunk's residual is the codec's own tensor, which the next rounds update in place.
        if residual is not None and len(self.states) == 1:
            residual = residual.clone()
        return residual

    def restore(self, residual: torch.Tensor | None) -> None:
        """Hand each chunk its slice of a checkpoint's flat residual (None: start empty)."""
        split_residual(self.states, residual, self.bounds)
