"""How a built-in task is made: a built-in model on a built-in data set, cross-entropy, SGD with
momentum and weight decay, linear warm-up then cosine (or constant) learning rate.

`digits`, `shapes` and `synthetic` each expose one function per model, made by `task_function`;
their JSON arguments are `lr`, `momentum`, `weight_decay`, `schedule`, `warmup_steps`,
`image_size` (the images averaged down to this side), `eval_samples` (scored on a fixed
sample of this many held-out images, not all of them) and, for digits, `holdout` (the held-out
fraction, 0.2 by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.task import Task, accuracy
from hybridtrain.tasks import datasets, models

SCHEDULES = ("cosine", "constant")


def lr_factor(index: int, *, max_steps: int, warmup_steps: int, schedule: str) -> float:
    """The learning rate of 1-based step `index + 1` as a fraction of the peak.

    Linear warm-up over `warmup_steps`, then constant, or cosine down to zero at `max_steps`.
    `index` is LambdaLR's count of scheduler steps taken, so the optimizer's first step (index
    0) trains at step 1's rate.
    """
    step = index + 1
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, max_steps: int, *, warmup_steps: int,
                  schedule: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `lr_factor`; step it once after every optimizer step."""
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_factor, max_steps=max_steps, warmup_steps=warmup_steps, schedule=schedule))


def sgd(model: nn.Module, *, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """SGD with momentum; weight decay on weight matrices and kernels only, never on biases
    and norm parameters (dim <= 1), as the trainer applied it before tasks existed."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.SGD([g for g in groups if g["params"]], lr=lr, momentum=momentum)


def _number(name: str, value: Any, ok: Callable[[float], bool], expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not ok(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def image_task(dataset: str, model: str, *, lr: float = 0.1, momentum: float = 0.9,
               weight_decay: float = 5e-4, schedule: str = "cosine", warmup_steps: int = 10,
               image_size: int | None = None, eval_samples: int | None = None,
               holdout: float | None = None) -> Task:
    """The built-in `model` on the built-in `dataset` (digits split `holdout` held-out, images
    averaged down to `image_size`, scored on a fixed sample of `eval_samples` held-out images);
    ValueError naming a bad argument."""
    if model not in models.MODELS:
        raise ValueError(f"model {model!r}: expected one of {', '.join(models.MODELS)}")
    lr = _number("lr", lr, lambda v: v > 0, "a number > 0")
    momentum = _number("momentum", momentum, lambda v: 0 <= v < 1, "a number in [0, 1)")
    weight_decay = _number("weight_decay", weight_decay, lambda v: v >= 0, "a number >= 0")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    data = datasets.load(dataset, holdout)
    if image_size is not None:
        data = data.resized(image_size)
    return Task(
        model=partial(models.build, model, data.input_shape, data.num_classes),
        train_data=data.train(),
        eval_data=data.eval(eval_samples),
        loss=F.cross_entropy,
        optimizer=partial(sgd, lr=lr, momentum=momentum, weight_decay=weight_decay),
        metrics=[accuracy()],
        schedule=partial(warmup_cosine, warmup_steps=warmup_steps, schedule=schedule),
        collate=datasets.batched,
    )


def task_function(module: str, dataset: str, model: str, doc: str) -> Callable[..., Task]:
    """The public task function `module:model`: `model` on `dataset`, with the keyword arguments
    of `image_task` (defaults lr=0.1, momentum=0.9, weight_decay=5e-4, cosine, 10 warm-up steps)."""

    def make(*, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 5e-4,
             schedule: str = "cosine", warmup_steps: int = 10, image_size: int | None = None,
             eval_samples: int | None = None, holdout: float | None = None) -> Task:
        return image_task(dataset, model, lr=lr, momentum=momentum, weight_decay=weight_decay,
                          schedule=schedule, warmup_steps=warmup_steps, image_size=image_size,
                          eval_samples=eval_samples, holdout=holdout)

    make.__name__ = make.__qualname__ = model
    make.__module__ = module
    make.__doc__ = doc
    return make
