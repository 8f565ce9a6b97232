"""How the parameter-server worker drives a torch optimizer (seed 000, steps 1 and 4; the
module `trainer.ps` says where each runs): an SGD optimizer's weight decay moves out of the
optimizer into the local gradient, so it is compressed and fed back like the gradient, and
under momentum correction the compressed tensors' update is applied as plain SGD, their
momentum being in the codec's velocity already. Any other optimizer is used as it is."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.algorithm import correction_momentum

# The worker's logger: its warnings belong to the worker's log.
log = logging.getLogger("trainer.ps")


@dataclass
class SgdRules:
    """What `adapt_sgd` took out of the optimizer: per group decay, and the velocity's factor."""

    decay: list[float] = field(default_factory=list)  # per param group, moved out of the optimizer
    momentum: float = 0.0  # the velocity's factor; 0 when momentum correction is off


def adapt_sgd(optimizer: torch.optim.Optimizer, compressed: AbstractSet[nn.Parameter], *,
              momentum_correction: bool) -> SgdRules:
    """Take an SGD optimizer's weight decay out of it and, with `momentum_correction`, read
    the one momentum factor of the `compressed` tensors' groups (none: correction is off)."""
    rules = SgdRules()
    if not isinstance(optimizer, torch.optim.SGD):
        return rules
    for group in optimizer.param_groups:
        rules.decay.append(float(group.get("weight_decay", 0.0)))
        group["weight_decay"] = 0.0
    if not momentum_correction:
        return rules
    groups = [g for g in optimizer.param_groups if any(p in compressed for p in g["params"])]
    momentum = correction_momentum(groups)
    if momentum is not None:
        rules.momentum = momentum
    else:
        log.warning("momentum correction needs one momentum factor, no dampening and no Nesterov "
                    "across the compressed tensors' groups; it is off for this run")
    return rules


def add_decay(optimizer: torch.optim.Optimizer, rules: SgdRules) -> None:
    """Add each group's decay to its parameters' gradients (taken out of the optimizer so that
    it reaches the compressed gradient, as the paper's step 1 has it)."""
    if not any(rules.decay):
        return
    with torch.no_grad():
        for group, decay in zip(optimizer.param_groups, rules.decay):
            if decay:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(p, alpha=decay)


def sgd_step(optimizer: torch.optim.Optimizer, params: AbstractSet[nn.Parameter]) -> None:
    """Plain SGD (p -= lr * grad) on `params`, at each one's group's learning rate."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p in params:
                    p.add_(p.grad, alpha=-group["lr"])


def hyperparameter_values(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every group's settings but its parameters (a user's scheduler may change them each step)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


@contextmanager
def hyperparameters(optimizer: torch.optim.Optimizer, values: list[dict] | None) -> Iterator[None]:
    """The optimizer's groups set to `values` (None: as they are) for the block, then back: a
    late chunk (apply-in-forward) is applied with the settings of the step it belongs to."""
    if values is None:
        yield
        return
    now = hyperparameter_values(optimizer)
    for group, held in zip(optimizer.param_groups, values):
        group.update(held)
    try:
        yield
    finally:
        for group, held in zip(optimizer.param_groups, now):
            group.update(held)
