"""Regression on scikit-learn's diabetes data (442 patients, 10 features, bundled: no download).

A hybridtrain task: `hybridtrain train --task diabetes:task --target 'val_loss<=0.6'`.
Features and target are standardised with the training split's statistics, so `val_loss` (the
MSE on the held-out split) is in units of the target's variance: 1.0 is predicting the mean.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import TensorDataset

import hybridtrain


def split(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Standardised train and held-out sets; the split is fixed by `seed`, the same on every rank."""
    x, y = load_diabetes(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * test_fraction)
    test, train = order[:cut], order[cut:]
    x_mean, x_std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = y[train].mean(), y[train].std()

    def tensors(idx: np.ndarray) -> TensorDataset:
        xs = torch.tensor((x[idx] - x_mean) / x_std, dtype=torch.float32)
        ys = torch.tensor((y[idx] - y_mean) / y_std, dtype=torch.float32)
        return TensorDataset(xs, ys)

    return tensors(train), tensors(test)


class MLP(nn.Module):
    """10 features -> hidden -> hidden -> 1 value."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def absolute_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample |error| (standardised units); the trainer averages it into `mae`."""
    return (output - target).abs()


def task(hidden: int = 64, lr: float = 1e-2, weight_decay: float = 0.0,
         test_fraction: float = 0.2) -> hybridtrain.Task:
    """The diabetes regression task; every argument can be set with --task-args JSON."""
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden must be a positive integer, got {hidden!r}")
    train, test = split(test_fraction)
    return hybridtrain.Task(
        model=lambda: MLP(hidden),
        train_data=train,
        eval_data=test,
        loss=F.mse_loss,
        optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay),
        metrics=[hybridtrain.Metric("mae", absolute_error, higher_is_better=False)],
    )
