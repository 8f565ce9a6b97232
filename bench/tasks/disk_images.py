"""A task whose training set lives on disk, one .npy file per sample (bench/dataloader.py).

The files are written once by `write_images(root, n)`: 3x32x32 float32 images of the
procedural shapes set (hybridtrain.tasks.datasets.make_shapes), 12 KiB each. Every sample is
read from its file when the loader asks for it; nothing is held in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import hybridtrain
from hybridtrain.tasks.datasets import make_shapes
from hybridtrain.tasks.models import SmallCNN


class ImageFiles(Dataset):
    """Samples read from `root/<i>.npy` with their label from `root/labels.npy`."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.labels = np.load(self.root / "labels.npy")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.load(self.root / f"{i}.npy")), int(self.labels[i])


def write_images(root: str | Path, n: int) -> None:
    """`n` shapes images as files under `root`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    x, y = make_shapes(n, seed=1)
    for i, image in enumerate(x):
        np.save(root / f"{i}.npy", image)
    np.save(root / "labels.npy", y)


def task(root: str, width: int = 32, lr: float = 0.05) -> hybridtrain.Task:
    """SmallCNN of `width` on the images under `root` (the last 500 held out)."""
    data = ImageFiles(root)
    n = len(data)
    train = torch.utils.data.Subset(data, range(0, n - 500))
    held_out = torch.utils.data.Subset(data, range(n - 500, n))
    return hybridtrain.Task(
        model=lambda: SmallCNN(3, 10, width=width),
        train_data=train, eval_data=held_out, loss=F.cross_entropy,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        metrics=[hybridtrain.accuracy()],
    )
