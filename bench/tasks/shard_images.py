"""The shapes images as a data set of shards read through hybridtrain.dataset (bench/datasets.py):
the same SmallCNN and images as bench/tasks/disk_images.py, held out the same 500."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import hybridtrain
from hybridtrain.datasets import write_dataset
from hybridtrain.tasks.datasets import make_shapes
from hybridtrain.tasks.models import SmallCNN


def write_images(root: str | Path, n: int, shard_bytes: int) -> None:
    """`n` shapes images (3x32x32 float32, 12 KiB) with their labels, as shards under `root`."""
    x, y = make_shapes(n, seed=1)
    write_dataset(((torch.from_numpy(x[i]), int(y[i])) for i in range(n)), root, shard_bytes=shard_bytes)


def task(name: str = "shapes", width: int = 32, lr: float = 0.05) -> hybridtrain.Task:
    """SmallCNN of `width` on the run's data set `name`."""
    return hybridtrain.Task(
        model=lambda: SmallCNN(3, 10, width=width), train_data=hybridtrain.dataset(name),
        loss=F.cross_entropy,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
    )
