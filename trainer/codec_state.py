"""What the worker (`trainer.ps`) and the server (`trainer.server`) hold alike of a run's
compression: the codec its config names, the chunk whose frames carry the dense part, and the
chunks' error-feedback residuals as one flat tensor, the shape a checkpoint keeps whatever the
chunking (--pipeline-chunks may differ between the run that wrote it and the one resuming)."""

from __future__ import annotations

import torch

from trainer.compression import (
    CompressionState,
    Compressor,
    ErrorFeedback,
    FP8Values,
    FP16Values,
    Identity,
    build_compressor,
)
from trainer.config import TrainConfig

# The chunk whose frames carry the dense part (1-D and small tensors): the first, so that it
# leaves first and its update, the dense tensors' optimizer step, is applied first.
DENSE_CHUNK = 0


def codec(cfg: TrainConfig, name: str) -> Compressor:
    """The compressor `name` as `cfg` configures it; the identity for a strategy that sends dense,
    except local SGD's, whose dense pseudo-gradients travel at --value-dtype with error feedback
    (an outer step is rare and large, so halving its bytes pays, and the rounding is sent later)."""
    if not cfg.compresses:
        if not cfg.is_local_sgd or cfg.value_dtype == "fp32":
            return Identity()
        narrow: Compressor = FP16Values(Identity()) if cfg.value_dtype == "fp16" else FP8Values(Identity())
        return ErrorFeedback(narrow) if cfg.error_feedback else narrow
    return build_compressor(name, value_dtype=cfg.value_dtype, error_feedback=cfg.error_feedback,
                            select=cfg.select)


def sends_dense(cfg: TrainConfig, step: int) -> bool:
    """Whether `step` sends the whole tensor in fp32, bypassing the codec: the warm-up steps and
    the uncompressed PS strategies; local SGD only at --value-dtype fp32 without compression (its
    outer steps come after H local steps, so they need no warm-up)."""
    if cfg.is_local_sgd:
        return isinstance(codec(cfg, cfg.compressor), Identity)
    return step <= cfg.warmup_steps or not cfg.compresses




def join_residuals(states: list[CompressionState]) -> torch.Tensor | None:
    """One flat residual of the chunks' (None until every chunk has one)."""
    if any(s.residual is None for s in states):
        return None
    return states[0].residual if len(states) == 1 else torch.cat([s.residual for s in states])


def split_residual(states: list[CompressionState], residual: torch.Tensor | None,
                   bounds: tuple[tuple[int, int], ...]) -> None:
    """Hand each chunk's state its slice of a flat `residual` (None: start empty)."""
    for s, (a, b) in zip(states, bounds):
        s.residual = None if residual is None else residual[a:b].clone()
