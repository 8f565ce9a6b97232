"""A small CNN on scikit-learn's digits, trained two ways (see README.md):

    python train_plain.py --epochs 5                                      # plain PyTorch
    hybridtrain launch --workers 2 --target 'accuracy>=0.95' train.py --epochs 10

train.py is train_plain.py with the lines `diff -u train_plain.py train.py` shows.
"""

import argparse

import hybridtrain as ht
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """1,797 8x8 digits (bundled with scikit-learn), 360 of them held out."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        )
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    ctx = ht.init(global_batch=64)
    device = ctx.device
    train_set, test_set = datasets()
    model = ht.prepare_model(Net())
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
    loader = ht.data_loader(train_set)
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step(loss=loss)
        accuracy = ht.evaluate(model, test_set, metrics=[ht.accuracy()], loss=F.cross_entropy)["accuracy"]
        print(f"epoch {epoch}: accuracy {accuracy:.3f}")
        if ctx.should_stop:
            break


if __name__ == "__main__":
    main()
