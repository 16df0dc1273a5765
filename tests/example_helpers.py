"""Helpers for the tests of examples/pytorch-cifar: import its modules, write tiny CIFAR-10 files."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import TypeVar

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pytorch-cifar"
sys.path.insert(0, str(EXAMPLE))

CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]

Index = TypeVar("Index", int, np.ndarray)  # one pixel, or np.indices grids of them


def cifar_pixel(i: Index, channel: Index, y: Index, x: Index) -> Index:
    """The value the tiny files hold at image i, channel, row y, column x: every pixel is known in advance."""
    return (7 * i + 50 * channel + 3 * y + x) % 256


def write_cifar_batch(path: Path, first: int, count: int) -> None:
    """A CIFAR-10 python batch of `count` images numbered from `first`, label = number % 10."""
    i, c, y, x = np.indices((count, 3, 32, 32))
    rows = cifar_pixel(first + i, c, y, x).astype(np.uint8).reshape(count, 3072)  # planes R, G, B; rows of 32
    with open(path, "wb") as fh:
        pickle.dump(
            {b"batch_label": b"tiny", b"data": rows, b"labels": [(first + k) % 10 for k in range(count)]},
            fh,
            protocol=2,
        )


def write_cifar_dir(folder: Path, per_batch: int = 4, test: int = 3) -> Path:
    """cifar-10-batches-py in `folder`: five training batches of `per_batch` images and a test batch of `test`."""
    target = folder / "cifar-10-batches-py"
    target.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(CIFAR_FILES[:5]):
        write_cifar_batch(target / name, i * per_batch, per_batch)
    write_cifar_batch(target / "test_batch", 1000, test)
    return target
