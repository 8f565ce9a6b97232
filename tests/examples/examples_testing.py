"""A plain-torch training loop over a Task, the reference the examples' targets are measured by."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hybridtrain.task import Task

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def train_until(task: Task, *, target: tuple[str, float], batch: int, max_steps: int,
                eval_every: int, seed: int = 0) -> tuple[int | None, list[float]]:
    """Train with `task`'s model, optimizer, schedule and loss until metric <= value (lower is
    better) or `max_steps`; returns (the step it was reached or None, val scores seen)."""
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer(model)
    sched = task.schedule(opt, max_steps) if task.schedule else None
    loader = DataLoader(task.train_data, batch_size=batch, shuffle=True, collate_fn=task.collate)
    name, value = target
    seen: list[float] = []
    step = 0
    while step < max_steps:
        for x, y in loader:
            opt.zero_grad()
            task.loss(model(x), y).backward()
            opt.step()
            if sched is not None:
                sched.step()
            step += 1
            if step % eval_every == 0:
                score = scores(task, model)[name]
                seen.append(score)
                if score <= value:
                    return step, seen
            if step >= max_steps:
                break
    return None, seen


def scores(task: Task, model: torch.nn.Module) -> dict[str, float]:
    """val_loss and the task's metrics on its evaluation data (per-sample means)."""
    loader = DataLoader(task.eval_data, batch_size=task.eval_batch_size, collate_fn=task.collate)
    sums = {"val_loss": 0.0, **{m.name: 0.0 for m in task.metrics}}
    n = 0
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            out, k = model(x), len(y)
            sums["val_loss"] += float(task.loss(out, y)) * k
            for m in task.metrics:
                v = m.fn(out, y)
                sums[m.name] += float(v.sum()) if v.dim() else float(v) * k
            n += k
    model.train()
    return {name: total / n for name, total in sums.items()}
