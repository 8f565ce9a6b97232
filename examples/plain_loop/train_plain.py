"""A small CNN on scikit-learn's digits, trained two ways (see README.md):

    python train_plain.py --epochs 5                                      # plain PyTorch
    hybridtrain launch --workers 2 --target 'accuracy>=0.95' train.py --epochs 10

train.py is train_plain.py with the lines `diff -u train_plain.py train.py` shows.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, test_set = datasets()
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(train_set, batch_size=64, shuffle=True)
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            x, y = test_set.tensors
            accuracy = (model(x.to(device)).argmax(1) == y.to(device)).float().mean().item()
        print(f"epoch {epoch}: accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
