"""Gaussian blobs as a data set of shards read through hybridtrain.dataset: a linear classifier
that passes 90 % held-out accuracy within two epochs of a few hundred samples (the testbed's
data set run, bench/dataset_testbed.py). The samples are files that `hybridtrain datasets
create` shards."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import hybridtrain

FEATURES, CLASSES = 1024, 4  # 4 KiB a sample: a data set of a few hundred is a few MiB


def blobs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` samples around CLASSES fixed means (the same for every seed), labels round robin."""
    means = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 0.2
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % CLASSES
    return means[y] + torch.randn(n, FEATURES, generator=gen), y


def write_sample_files(folder: str | Path, n: int, seed: int = 1) -> None:
    """One `KEY.pth` file per sample, (features, label): the folder `datasets create --from` takes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    x, y = blobs(n, seed)
    for i in range(n):
        torch.save((x[i].clone(), int(y[i])), folder / f"{i:06d}.pth")


def task(name: str = "blobs", lr: float = 0.01) -> hybridtrain.Task:
    """A linear classifier on the run's data set `name`, scored on 256 held-out blobs."""
    x, y = blobs(256, seed=2)
    return hybridtrain.Task(
        model=lambda: torch.nn.Linear(FEATURES, CLASSES),
        train_data=hybridtrain.dataset(name),
        eval_data=torch.utils.data.TensorDataset(x, y),
        loss=F.cross_entropy,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        metrics=[hybridtrain.accuracy()],
    )
