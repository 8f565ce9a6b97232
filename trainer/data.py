"""Data sets that need no download: sklearn's digits, a procedural shapes set, synthetic noise.

Every rank builds the same arrays deterministically; which samples a worker trains on is decided
by `batch_indices`, a pure function of the step (step 1: each worker's share of an epoch is its
n_m-slice of every global batch, so shards are sized in proportion to n_m and re-balancing only
changes the slice widths).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

DATASETS = ("digits", "shapes", "synthetic")
SPLIT_SEED = 0  # the held-out split never moves with --seed, so runs stay comparable


@dataclass(frozen=True)
class Dataset:
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


def _standardise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = x_train.mean(), x_train.std() + 1e-6
    return (
        torch.from_numpy(((x_train - mean) / std).astype(np.float32)),
        torch.from_numpy(((x_test - mean) / std).astype(np.float32)),
    )


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's digits CSV read straight from the installed package: importing
    sklearn.datasets would pull in scipy, a second of start-up in every role."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-learn is not installed; it ships the digits data set")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
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


def load_digits_dataset(test_fraction: float = 0.2) -> Dataset:
    """sklearn's 1,797 8x8 handwritten digits (shipped inside sklearn), stratified 80/20 split."""
    x, y = _digits_arrays()
    tr, te = stratified_split(y, test_fraction, SPLIT_SEED)
    xt, xe = _standardise(x[tr], x[te])
    return Dataset(xt, torch.from_numpy(y[tr]), xe, torch.from_numpy(y[te]), 10)


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


def load_shapes_dataset(n_train: int = 8000, n_test: int = 2000) -> Dataset:
    """The procedural shapes set: `n_train` + `n_test` images generated locally, fixed seeds."""
    x_tr, y_tr = make_shapes(n_train, seed=SPLIT_SEED + 1)
    x_te, y_te = make_shapes(n_test, seed=SPLIT_SEED + 2)
    xt, xe = _standardise(x_tr, x_te)
    return Dataset(xt, torch.from_numpy(y_tr), xe, torch.from_numpy(y_te), 10)


def load_synthetic_dataset(n: int = 4096, shape: tuple[int, ...] = (3, 32, 32)) -> Dataset:
    """Gaussian noise with random labels: for throughput only, accuracy is meaningless."""
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    x = torch.randn((n, *shape), generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return Dataset(x, y, x[:256].clone(), y[:256].clone(), 10)


@lru_cache(maxsize=2)
def load_dataset(name: str) -> Dataset:
    """A data set by name (cached per process)."""
    if name == "digits":
        return load_digits_dataset()
    if name == "shapes":
        return load_shapes_dataset()
    if name == "synthetic":
        return load_synthetic_dataset()
    raise ValueError(f"dataset {name!r}: expected one of {DATASETS}")


@lru_cache(maxsize=4)
def _epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=gen)


def batch_indices(step: int, worker: int, batch_sizes: tuple[int, ...], n_train: int, seed: int) -> torch.Tensor:
    """Indices of worker `worker`'s batch at 1-based `step`: its slice of that step's global batch.

    The global batches of an epoch tile one permutation of the training set, so a PS step sees
    exactly the samples one large-batch SGD step would.
    """
    global_batch = sum(batch_sizes)
    if global_batch > n_train:
        raise ValueError(f"global batch {global_batch} exceeds the {n_train} training samples")
    per_epoch = n_train // global_batch
    epoch, within = divmod(step - 1, per_epoch)
    start = within * global_batch + sum(batch_sizes[:worker])
    return _epoch_permutation(n_train, seed, epoch)[start : start + batch_sizes[worker]]


def eval_slice(n_test: int, worker: int, batch_sizes: tuple[int, ...]) -> slice:
    """The contiguous part of the held-out set a worker scores, in proportion to its batch.

    A worker's batch share is its share of the compute, so every worker finishes scoring at once,
    as it finishes a step; equal parts would leave the fast workers waiting on the slow ones.
    """
    weights = np.asarray(batch_sizes, dtype=np.float64)
    if weights.size == 0 or (weights <= 0).any():
        raise ValueError(f"eval_slice: batch sizes must be positive, got {list(batch_sizes)}")
    bounds = (np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum() * n_test).round().astype(int)
    return slice(int(bounds[worker]), int(bounds[worker + 1]))
