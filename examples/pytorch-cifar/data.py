"""Data of the example: CIFAR-10 (prepared by prepare.sh into data/) or the embedded digits.

The loading itself is :mod:`dpwa_lab.workloads.images` (the comparison trains the
same data); this module gives it the example's CIFAR-10 folder,
``examples/pytorch-cifar/data/cifar-10-batches-py``.

    .venv/bin/python examples/pytorch-cifar/data.py --data digits     # prints the split sizes
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dpwa_lab.workloads import images
from dpwa_lab.workloads.images import (
    CIFAR_MEAN,
    CIFAR_STD,
    DATASETS,
    Dataset,
    augment,
    batches,
    read_cifar_batch,
    steps_per_epoch,
)

__all__ = [
    "CIFAR_MEAN",
    "CIFAR_STD",
    "DATASETS",
    "DEFAULT_CIFAR_DIR",
    "Dataset",
    "augment",
    "batches",
    "cifar_is_prepared",
    "load",
    "load_cifar10",
    "load_digits",
    "read_cifar_batch",
    "resolve",
    "steps_per_epoch",
]

DEFAULT_CIFAR_DIR = Path(__file__).resolve().parent / "data" / "cifar-10-batches-py"
load_digits = images.load_digits


def cifar_is_prepared(data_dir: Path = DEFAULT_CIFAR_DIR) -> bool:
    return images.cifar_is_prepared(data_dir)


def load_cifar10(data_dir: Path = DEFAULT_CIFAR_DIR) -> Dataset:
    return images.load_cifar10(data_dir)


def load(name: str, data_dir: Path = DEFAULT_CIFAR_DIR) -> Dataset:
    """The dataset called `name` (digits or cifar10)."""
    return images.load(name, data_dir)


def resolve(name: str, data_dir: Path = DEFAULT_CIFAR_DIR) -> str:
    """``auto`` becomes cifar10 when its files are prepared in `data_dir`, else digits."""
    return images.resolve(name, data_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="auto", choices=("auto",) + DATASETS)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_CIFAR_DIR)
    args = parser.parse_args()
    dataset = load(resolve(args.data, args.data_dir), args.data_dir)
    print(
        f"{dataset.name}: {len(dataset.train_y)} training and {len(dataset.test_y)} test images "
        f"of shape {tuple(dataset.train_x.shape[1:])}"
    )
