"""The built-in data sets, none downloaded: scikit-learn's digits, procedural shapes, noise.

Every process builds the same arrays deterministically (byte-identical to the trainer's data
sets before tasks existed, held-out splits included) and caches them, and serves them as
`TensorPairs`, a map-style torch Dataset that hands a whole batch over in one indexing op.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

DATASETS = ("digits", "shapes", "synthetic")
SPLIT_SEED = 0  # the held-out split never moves with the run's seed, so runs stay comparable


class TensorPairs(Dataset):
    """Samples `(x[i], y[i])` of two tensors of equal length.

    `__getitems__` lets torch's DataLoader fetch a batch with one indexing op instead of one
    `__getitem__` per sample (an epoch of digits at batch 64 reads 2.7x faster); pair it with
    `collate=batched`.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"TensorPairs: {len(x)} inputs but {len(y)} targets")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.x[idx], self.y[idx]


def batched(data: Any) -> Any:
    """The collate of a `TensorPairs` batch: `__getitems__` already made it, so pass it through.

    A list of single samples (a loader that read them one by one) is stacked as usual.
    """
    if isinstance(data, list):
        return default_collate(data)
    return data


@dataclass(frozen=True)
class Arrays:
    """Train and held-out tensors plus what a model needs to know about them."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample (C, H, W)."""
        return tuple(self.x_train.shape[1:])

    def train(self) -> TensorPairs:
        """The training split as a Dataset (sharing the cached tensors)."""
        return TensorPairs(self.x_train, self.y_train)

    def eval(self, samples: int | None = None) -> TensorPairs:
        """The held-out split as a Dataset, or a fixed sample of `samples` of it (the same one
        in every process and run: the evaluation's cost is bounded and its figures comparable)."""
        if samples is None:
            return TensorPairs(self.x_test, self.y_test)
        n = len(self.y_test)
        if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= n:
            raise ValueError(f"eval_samples must be an integer from 1 to {n} (the held-out set's size), "
                             f"got {samples!r}")
        gen = torch.Generator().manual_seed(SPLIT_SEED)
        keep = torch.randperm(n, generator=gen)[:samples].sort().values
        return TensorPairs(self.x_test[keep], self.y_test[keep])

    def resized(self, side: int) -> Arrays:
        """The same images at `side` x `side` pixels, averaged down (a reduced input size:
        a convolutional model's compute per sample falls with the pixel count)."""
        native = self.input_shape[-1]
        if len(self.input_shape) != 3 or isinstance(side, bool) or not isinstance(side, int) \
                or not 4 <= side <= native:
            raise ValueError(f"image_size must be an integer from 4 to {native} (the images' side), got {side!r}")
        if side == native:
            return self
        shrink = partial(torch.nn.functional.interpolate, size=(side, side), mode="area")
        return replace(self, x_train=shrink(self.x_train), x_test=shrink(self.x_test))


def _standardise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = x_train.mean(), x_train.std() + 1e-6
    return (
        torch.from_numpy(((x_train - mean) / std).astype(np.float32)),
        torch.from_numpy(((x_test - mean) / std).astype(np.float32)),
    )


def sklearn_data_file(name: str) -> Path:
    """A data file bundled inside scikit-learn (e.g. digits.csv.gz), found without importing
    sklearn.datasets: that import pulls in scipy, a second of start-up in every process."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-learn is not installed; it ships the built-in data sets")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / name


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(sklearn_data_file("digits.csv.gz"), delimiter=",", dtype=np.float32)
    return table[:, :-1].reshape(-1, 1, 8, 8) / 16.0, table[:, -1].astype(np.int64)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices with every class split in the same proportion."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        cut = int(round(len(idx) * test_fraction))
        test.append(idx[:cut])
        train.append(idx[cut:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_digits(test_fraction: float = 0.2) -> Arrays:
    """sklearn's 1,797 8x8 handwritten digits (shipped inside sklearn), stratified 80/20 split."""
    x, y = _digits_arrays()
    tr, te = stratified_split(y, test_fraction, SPLIT_SEED)
    xt, xe = _standardise(x[tr], x[te])
    return Arrays(xt, torch.from_numpy(y[tr]), xe, torch.from_numpy(y[te]), 10)


SHAPE_CLASSES = (
    "disc", "ring", "square", "frame", "triangle", "plus", "cross", "hbars", "vbars", "diamond",
)


def _shape_masks(label: int, dx: np.ndarray, dy: np.ndarray, r: np.ndarray) -> np.ndarray:
    ax, ay, dist = np.abs(dx), np.abs(dy), np.hypot(dx, dy)
    inside = (ax <= r) & (ay <= r)
    name = SHAPE_CLASSES[label]
    if name == "disc":
        return dist <= r
    if name == "ring":
        return (dist <= r) & (dist >= r - 2.0)
    if name == "square":
        return (ax <= 0.8 * r) & (ay <= 0.8 * r)
    if name == "frame":
        edge = np.maximum(ax, ay)
        return (edge <= r) & (edge >= r - 2.0)
    if name == "triangle":
        return (dy >= -r) & (dy <= r) & (ax <= (dy + r) / 2.0)
    if name == "plus":
        return ((ax <= 1.5) & (ay <= r)) | ((ay <= 1.5) & (ax <= r))
    if name == "cross":
        return ((np.abs(dx - dy) <= 1.5) | (np.abs(dx + dy) <= 1.5)) & inside
    if name == "hbars":
        return inside & (np.floor((dy + r) / 3.0) % 2 == 0)
    if name == "vbars":
        return inside & (np.floor((dx + r) / 3.0) % 2 == 0)
    return ax + ay <= r  # diamond


def make_shapes(n: int, seed: int, size: int = 32, noise: float = 0.35) -> tuple[np.ndarray, np.ndarray]:
    """`n` RGB images of 10 procedural shape classes at random position, size and colours.

    Harder than digits: class evidence is a thin outline or a texture, colours are random per
    image (so colour carries no label), a random distractor blob overlaps, pixel noise is heavy.
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, len(SHAPE_CLASSES), n)
    grid = np.arange(size, dtype=np.float32)
    xx, yy = grid[None, None, :], grid[None, :, None]
    cx = rng.uniform(10, size - 10, (n, 1, 1))
    cy = rng.uniform(10, size - 10, (n, 1, 1))
    r = rng.uniform(5, 9, (n, 1, 1))
    mask = np.zeros((n, size, size), dtype=bool)
    for label in range(len(SHAPE_CLASSES)):
        sel = y == label
        mask[sel] = _shape_masks(label, xx - cx[sel], yy - cy[sel], r[sel])
    bx, by = rng.uniform(0, size, (n, 1, 1)), rng.uniform(0, size, (n, 1, 1))
    blob = np.hypot(xx - bx, yy - by) <= rng.uniform(2, 4, (n, 1, 1))
    fg = rng.uniform(0, 1, (n, 3, 1, 1)).astype(np.float32)
    bg = rng.uniform(0, 1, (n, 3, 1, 1)).astype(np.float32)
    distract = rng.uniform(0, 1, (n, 3, 1, 1)).astype(np.float32)
    img = np.where(mask[:, None], fg, bg)
    img = np.where(blob[:, None] & ~mask[:, None], distract, img)
    img = img + rng.normal(0, noise, img.shape).astype(np.float32)
    return img.astype(np.float32), y.astype(np.int64)


def load_shapes(n_train: int = 8000, n_test: int = 2000) -> Arrays:
    """The procedural shapes set: `n_train` + `n_test` images generated locally, fixed seeds."""
    x_tr, y_tr = make_shapes(n_train, seed=SPLIT_SEED + 1)
    x_te, y_te = make_shapes(n_test, seed=SPLIT_SEED + 2)
    xt, xe = _standardise(x_tr, x_te)
    return Arrays(xt, torch.from_numpy(y_tr), xe, torch.from_numpy(y_te), 10)


def load_synthetic(n: int = 4096, shape: tuple[int, ...] = (3, 32, 32)) -> Arrays:
    """Gaussian noise with random labels: for throughput only, accuracy is meaningless (the
    held-out set is the first 256 training samples)."""
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    x = torch.randn((n, *shape), generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return Arrays(x, y, x[:256].clone(), y[:256].clone(), 10)


@lru_cache(maxsize=4)
def load(name: str, holdout: float | None = None) -> Arrays:
    """A built-in data set by name, built once per process; `holdout` is digits' held-out
    fraction (0.2 unless given; the other sets generate theirs apart)."""
    if holdout is not None:
        if name != "digits":
            raise ValueError(f"holdout: only digits is split into training and held-out data, not {name}")
        if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0.05 <= holdout <= 0.8:
            raise ValueError(f"holdout must be a fraction from 0.05 to 0.8, got {holdout!r}")
        return load_digits(float(holdout))
    if name == "digits":
        return load_digits()
    if name == "shapes":
        return load_shapes()
    if name == "synthetic":
        return load_synthetic()
    raise ValueError(f"dataset {name!r}: expected one of {', '.join(DATASETS)}")
