"""The built-in models: a small CNN for CPU runs and its wide variant (the testbed benchmark's),
a ~25M-parameter wide MLP, torchvision ResNets.

Same classes, parameter shapes and initialisation order as before tasks existed, so a given
torch seed still gives the same weights. ResNets are built with weights=None; for inputs of 64
pixels or less the stem is the CIFAR one (3x3 stride-1 first convolution, no max-pool): the
ImageNet stem would shrink an 8x8 digit to one pixel before the first block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

MODELS = ("smallcnn", "widecnn", "widemlp", "resnet18", "resnet50", "resnet152")
# The testbed benchmark's model (docs/testbed.md): SmallCNN at width 192, 3.35M parameters on
# digits, so a dense gradient takes about 2 s over 100 Mbit/s while its convolutions keep a
# step's compute at 1-2 s on a CPU share: communication-bound as the paper's ResNet-152 was.
WIDECNN_WIDTH = 192


class SmallCNN(nn.Module):
    """Three 3x3 conv + BatchNorm blocks and a linear head (~26k parameters for digits)."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        self.features = nn.Sequential(
            *block(in_channels, width),
            *block(width, 2 * width),
            nn.MaxPool2d(2),
            *block(2 * width, 4 * width),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.head(self.features(x))


def wide_mlp(in_features: int, num_classes: int, width: int = 4096) -> nn.Sequential:
    """in -> width -> width -> width/2 -> classes; 25.4M parameters at width 4096 on digits."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width // 2),
        nn.ReLU(),
        nn.Linear(width // 2, num_classes),
    )


def resnet(name: str, in_channels: int, num_classes: int, side: int) -> nn.Module:
    """torchvision's `name` (resnet18/50/152), untrained, with the CIFAR stem for small inputs."""
    import torchvision  # a second of import time: only for the tasks that use it

    model = getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    if side <= 64:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return model


def build(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A freshly initialised model `name` for samples of `input_shape` (C, H, W); unseeded."""
    channels, side = input_shape[0], input_shape[-1]
    if name == "smallcnn":
        return SmallCNN(channels, num_classes)
    if name == "widecnn":
        return SmallCNN(channels, num_classes, width=WIDECNN_WIDTH)
    if name == "widemlp":
        return wide_mlp(math.prod(input_shape), num_classes)
    if name in ("resnet18", "resnet50", "resnet152"):
        return resnet(name, channels, num_classes, side)
    raise ValueError(f"model {name!r}: expected one of {', '.join(MODELS)}")
