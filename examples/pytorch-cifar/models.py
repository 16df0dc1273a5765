"""Models of the example: a small ResNet for CPU cores and the pre-activation ResNet-18 for GPUs.

Both take any square input size (8x8 digits, 32x32 CIFAR-10) and any number
of input channels: the last feature map is averaged over its whole extent.

    .venv/bin/python examples/pytorch-cifar/models.py      # prints each model's size
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("small", "resnet18")


class PreActBlock(nn.Module):
    """Pre-activation residual block (He et al. 2016, "Identity mappings in deep residual networks")."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.shortcut = None
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        skip = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + skip


class PreActResNet(nn.Module):
    """A stem convolution, stages of pre-activation blocks, global average pooling, a linear layer.

    Args:
        blocks: blocks per stage; each stage after the first halves the
            resolution and doubles the width.
        width: channels of the first stage.
        in_channels: 1 for digits, 3 for CIFAR-10.
        num_classes: outputs of the last layer.
    """

    def __init__(self, blocks: list[int], width: int, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        layers: list[nn.Module] = []
        planes = width
        for stage, count in enumerate(blocks):
            out_planes = width * 2**stage
            for i in range(count):
                layers.append(PreActBlock(planes, out_planes, stride=2 if stage > 0 and i == 0 else 1))
                planes = out_planes
        self.blocks = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(planes)
        self.fc = nn.Linear(planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        out = F.relu(self.bn(out))
        return self.fc(out.mean(dim=(2, 3)))


def build(name: str, in_channels: int, num_classes: int = 10, width: int = 16) -> nn.Module:
    """The model called `name`: ``small`` (3 stages of one block, `width` channels first) or ``resnet18``."""
    if name == "small":
        return PreActResNet([1, 1, 1], width, in_channels, num_classes)
    if name == "resnet18":  # the original example's network: 4 stages of 2 blocks, 64..512 channels
        return PreActResNet([2, 2, 2, 2], 64, in_channels, num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def count_parameters(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


if __name__ == "__main__":
    for model in MODELS:
        print(f"{model}: {count_parameters(build(model, 3)):,} parameters")
