"""The image workloads: CIFAR-10 or the embedded digits, held in memory as tensors, and the models that train on them.

What ``./run.sh`` (examples/pytorch-cifar) and ``python -m dpwa.compare``
train, in the package so that the comparison and the benchmark run from a
pip-installed dpwa too:

* ``cifar10``: the "python version" batches (``cifar-10-batches-py``, made by
  ``examples/pytorch-cifar/prepare.sh``): five training files of 10,000
  images and one test file, each a pickled dict with ``b"data"`` (N x 3072
  uint8, the red, green and blue planes of a 32x32 image) and ``b"labels"``.
  These files are pickles by format; read only files whose archive
  ``prepare.sh`` verified. Every function that reads them is given the folder.
* ``digits``: the 1,797 8x8 handwritten digits shipped with dpwa's lab
  (:mod:`dpwa_lab.workloads.digits`), split 80/20 into training and test images
  with a fixed seed.

Images stay uint8 until a batch is drawn; a batch is normalized and, when
training, augmented on tensors (random crop from a zero-padded image,
horizontal flip for CIFAR-10 only: a mirrored digit is another glyph).

The models: a small pre-activation ResNet for CPU cores and the
pre-activation ResNet-18 for GPUs. Both take any square input size and any
number of input channels: the last feature map is averaged over its extent.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .digits import load_digits as read_digits

__all__ = [
    "DATASETS",
    "MODELS",
    "Dataset",
    "augment",
    "batches",
    "build",
    "cifar_is_prepared",
    "count_parameters",
    "load",
    "load_cifar10",
    "load_digits",
    "read_cifar_batch",
    "resolve",
    "steps_per_epoch",
]

DATASETS = ("digits", "cifar10")
CIFAR_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_FILE = "test_batch"
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)  # per channel, of the training images scaled to [0, 1]
CIFAR_STD = (0.2470, 0.2435, 0.2616)
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed: every node and the evaluator see the same test images


@dataclass
class Dataset:
    """Training and test images (uint8, N x C x H x W) with labels, and how to turn them into inputs."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    scale: float  # pixel value that maps to 1.0
    mean: tuple[float, ...]  # per channel, after scaling
    std: tuple[float, ...]
    crop_padding: int  # random crop from an image padded by this many pixels; 0 disables
    flip: bool  # random horizontal flips
    num_classes: int = 10

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images to float inputs with zero mean and unit variance per channel."""
        mean = torch.tensor(self.mean, device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=images.device).view(1, -1, 1, 1)
        return (images.float() / self.scale - mean) / std

    def shard(self, index: int, count: int, seed: int = 0) -> Dataset:
        """This node's disjoint part of the training images: part `index` of `count` after a seeded shuffle.

        Every node shuffles with the same seed, so the parts are disjoint and
        together hold every training image once. The test images are shared.
        """
        if not 0 <= index < count:
            raise ValueError(f"shard index must be in 0..{count - 1}, got {index}")
        order = torch.randperm(len(self.train_y), generator=torch.Generator().manual_seed(seed))
        part = torch.tensor_split(order, count)[index]
        if len(part) == 0:
            raise ValueError(f"{self.name} has {len(self.train_y)} training images, too few for {count} shards")
        return Dataset(**{**self.__dict__, "train_x": self.train_x[part], "train_y": self.train_y[part]})


def read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One CIFAR-10 python batch file: images (N, 3, 32, 32) uint8 and labels (N,) int64."""
    try:
        with open(path, "rb") as fh:
            # The CIFAR-10 format is a pickle; prepare.sh verified the archive's MD5 before unpacking it.
            batch = pickle.load(fh, encoding="bytes")  # noqa: S301
    except OSError as exc:
        raise FileNotFoundError(
            f"{path}: cannot read the CIFAR-10 batch ({exc.strerror}); run examples/pytorch-cifar/prepare.sh"
        ) from exc
    except (pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise ValueError(f"{path}: not a CIFAR-10 python batch file ({exc}); run prepare.sh again") from exc
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path}: expected a dict with b'data' and b'labels', got {type(batch).__name__}")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise ValueError(
            f"{path}: expected uint8 data of shape (N, 3072) and N labels, "
            f"got {data.dtype} {data.shape} and {len(labels)} labels"
        )
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must be in 0..9, got {labels.min()}..{labels.max()}")
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels)


def cifar_is_prepared(data_dir: Path) -> bool:
    return all((Path(data_dir) / name).is_file() for name in CIFAR_TRAIN_FILES + (CIFAR_TEST_FILE,))


def load_cifar10(data_dir: Path) -> Dataset:
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"{data_dir}: no CIFAR-10 folder here; run examples/pytorch-cifar/prepare.sh "
            "or train on the embedded digits (--data digits)"
        )
    parts = [read_cifar_batch(data_dir / name) for name in CIFAR_TRAIN_FILES]
    test_x, test_y = read_cifar_batch(data_dir / CIFAR_TEST_FILE)
    return Dataset(
        "cifar10",
        torch.cat([x for x, _ in parts]),
        torch.cat([y for _, y in parts]),
        test_x,
        test_y,
        scale=255.0,
        mean=CIFAR_MEAN,
        std=CIFAR_STD,
        crop_padding=4,
        flip=True,
    )


def load_digits() -> Dataset:
    images, labels = read_digits()
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(labels))
    n_test = math.ceil(len(labels) * DIGITS_TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    x = torch.from_numpy(images).unsqueeze(1)  # (N, 1, 8, 8)
    y = torch.from_numpy(labels)
    scaled = x[train].float() / 16.0
    return Dataset(
        "digits",
        x[train],
        y[train],
        x[test],
        y[test],
        scale=16.0,
        mean=(scaled.mean().item(),),
        std=(scaled.std().item(),),
        crop_padding=1,
        flip=False,
    )


def load(name: str, data_dir: Path) -> Dataset:
    """The dataset called `name` (digits or cifar10)."""
    if name == "digits":
        return load_digits()
    if name == "cifar10":
        return load_cifar10(data_dir)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def resolve(name: str, data_dir: Path) -> str:
    """``auto`` becomes cifar10 when its files are prepared in `data_dir`, else digits."""
    if name != "auto":
        return name
    return "cifar10" if cifar_is_prepared(data_dir) else "digits"


def augment(x: torch.Tensor, padding: int, flip: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Random crops (from `x` zero-padded by `padding`) and, if `flip`, random horizontal flips, per image."""
    n, _, h, w = x.shape
    if padding:
        padded = F.pad(x, (padding, padding, padding, padding))
        dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
        dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
        rows = (dy[:, None] + torch.arange(h))[:, None, :, None]  # (n, 1, h, 1)
        cols = (dx[:, None] + torch.arange(w))[:, None, None, :]  # (n, 1, 1, w)
        x = padded[torch.arange(n)[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None], rows, cols]
    if flip:
        mirrored = torch.rand(n, generator=generator) < 0.5
        x = torch.where(mirrored[:, None, None, None], x.flip(3), x)
    return x


def batches(
    data: Dataset, batch_size: int, generator: torch.Generator | None, train: bool = True
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Normalized (input, label) batches: shuffled, augmented and full-sized when training; in order otherwise.

    `generator` draws the order and the augmentation (None: torch's global one); unused for the test images."""
    if train:
        order = torch.randperm(len(data.train_y), generator=generator)
        for start in range(0, len(order) - batch_size + 1, batch_size):  # a short last batch is dropped
            index = order[start : start + batch_size]
            x = augment(data.normalize(data.train_x[index]), data.crop_padding, data.flip, generator)
            yield x, data.train_y[index]
    else:
        for start in range(0, len(data.test_y), batch_size):
            yield data.normalize(data.test_x[start : start + batch_size]), data.test_y[start : start + batch_size]


def steps_per_epoch(data: Dataset, batch_size: int) -> int:
    return len(data.train_y) // batch_size


# --------------------------------------------------------------------------- models

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
