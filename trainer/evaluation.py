"""Evaluation of a replica on a worker's slice of the held-out data: per-metric sums and the
sample count, which the workers' sums combine into means over the whole set."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from hybridtrain.contract import VAL_LOSS
from trainer.devices import to_device


def _batch_len(target: Any) -> int:
    if isinstance(target, torch.Tensor):
        return int(target.shape[0]) if target.dim() else 1
    return len(target)


def _sum_of(value: Any, n: int) -> float:
    value = torch.as_tensor(value, dtype=torch.float64)
    # A 0-d value is the batch's mean; anything else holds one value per sample.
    return float(value) * n if value.dim() == 0 else float(value.sum())


@torch.no_grad()
def metric_sums(
    model: torch.nn.Module,
    dataset: Any,
    *,
    part: slice | tuple[int, int, int] | None,
    metrics: Sequence[Any],
    loss: Callable[[Any, Any], Any] | None,
    batch_size: int,
    device: torch.device,
    collate: Callable | None = None,
) -> tuple[dict[str, float], int]:
    """Sum each metric (and `val_loss` when `loss` is given) over this worker's part of
    `dataset`; returns (sums, samples). `part` is a slice of a map-style data set, or
    (lo, hi, period) for a stream: items whose position mod period falls in [lo, hi)."""
    if collate is None:
        from torch.utils.data import default_collate

        collate = default_collate
    was_training = model.training
    model.eval()
    sums = {m.name: 0.0 for m in metrics}
    if loss is not None:
        sums[VAL_LOSS] = 0.0
    count = 0
    try:
        for inputs, target in _batches(dataset, part, batch_size, collate):
            inputs, target = to_device(inputs, device), to_device(target, device)
            output = model(inputs)
            n = _batch_len(target)
            for m in metrics:
                sums[m.name] += _sum_of(m.fn(output, target), n)
            if loss is not None:
                sums[VAL_LOSS] += _sum_of(loss(output, target), n)
            count += n
    finally:
        model.train(was_training)
    return sums, count


def _batches(dataset: Any, part: Any, batch_size: int, collate: Callable) -> Any:
    if isinstance(dataset, IterableDataset):
        lo, hi, period = part if part is not None else (0, 1, 1)
        items = (x for i, x in enumerate(dataset) if lo <= i % period < hi)
        batch: list[Any] = []
        for item in items:
            batch.append(item)
            if len(batch) == batch_size:
                yield collate(batch)
                batch = []
        if batch:
            yield collate(batch)
        return
    part = part if part is not None else slice(0, len(dataset))
    indices = range(len(dataset))[part]
    batches = [list(indices[i : i + batch_size]) for i in range(0, len(indices), batch_size)]
    yield from DataLoader(dataset, batch_sampler=batches, collate_fn=collate)
