"""A replica's state as a STATE frame carries it: a joiner's start, a checkpoint, a resume
(docs/elastic.md). Under local SGD the weights are the common ones of the last outer step, and
the optimizer state holds the outer optimizer's beside the inner one's."""

from __future__ import annotations

import torch
from torch import nn

from trainer.algorithm import float_buffers
from trainer.checkpoint import from_bytes, to_bytes
from trainer.flat_model import FlatModel
from trainer.frames import State
from trainer.local_sgd import LocalSGD


def state_frame(rank: int, step: int, flat: FlatModel, model: nn.Module, optimizer: torch.optim.Optimizer,
                local: LocalSGD | None) -> State:
    """This replica's weights, float buffers and optimizer state at `step`."""
    buffers = float_buffers(model)
    values = torch.cat([b.reshape(-1).float().cpu() for b in buffers]) if buffers else torch.zeros(0)
    if local is None:
        return State(rank, flat.values().cpu(), values, step, to_bytes(optimizer.state_dict()))
    both = {"inner": optimizer.state_dict(), "outer": local.state_dict()}
    return State(rank, local.common.cpu(), values, local.synced_step, to_bytes(both))


def load_state(state: State, flat: FlatModel, model: nn.Module, optimizer: torch.optim.Optimizer,
               local: LocalSGD | None) -> None:
    """Take the run's weights, buffers and (when sent) optimizer state."""
    flat.load(state.params)
    with torch.no_grad():
        off = 0
        for b in float_buffers(model):
            b.copy_(state.buffers[off : off + b.numel()].view_as(b))
            off += b.numel()
    saved = from_bytes(state.optimizer) if state.optimizer else None
    if local is not None:
        local.reset(state.params.to(local.common.device), state.step)
        if isinstance(saved, dict) and "outer" in saved:
            local.load_state_dict(saved["outer"])
            saved = saved["inner"]
    if saved:
        # Written by an adapted optimizer (decay already moved into the gradient).
        optimizer.load_state_dict(saved)
