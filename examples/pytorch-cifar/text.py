"""The charlm workload in the example: dpwa_lab.workloads.charlm's transformer and text, in the shape train.py uses.

``./run.sh --workload charlm`` trains a small GPT-style character-level
transformer on the Python standard library's own source (``--data stdlib``,
the default) or on a text file of yours (``--data text:PATH``); nothing is
downloaded. Each node trains on its own part of the training text; its
evaluation is the validation loss in nats per character (and the
next-character accuracy) on fixed windows of the validation text. The model,
the split and the sizes are described in ``lab/dpwa_lab/workloads/charlm.py`` and
docs/comparison.md.

    .venv/bin/python examples/pytorch-cifar/text.py      # prints the text's and the model's sizes
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

import data as datasets
import torch
from torch import nn

from dpwa_lab.workloads import charlm

SIZES = tuple(charlm.SIZES)
EVAL_WINDOWS = 128  # validation windows each evaluation reads
WORKLOADS = ("digits", "cifar10", "charlm")


def data_source(value: str) -> str:
    """--data: auto, digits, cifar10 (images), stdlib or text:PATH (charlm)."""
    if value in ("auto", "stdlib") + datasets.DATASETS or (value.startswith("text:") and len(value) > 5):
        return value
    raise argparse.ArgumentTypeError(f"choose auto, {', '.join(datasets.DATASETS)}, stdlib or text:PATH; got {value!r}")


def resolve_workload(workload: str | None, data: str, data_dir: Path) -> tuple[str, str]:
    """(workload, data) from --workload and --data: charlm trains on text, the image workloads on their data."""
    text = data == "stdlib" or data.startswith("text:")
    if workload is None:
        workload = "charlm" if text else datasets.resolve(data, data_dir)
    if workload == "charlm":
        if not text and data != "auto":
            raise ValueError(f"--workload charlm trains on text: --data must be stdlib or text:PATH, got {data}")
        return workload, "stdlib" if data == "auto" else data
    if text or (data != "auto" and data != workload):
        raise ValueError(f"--workload {workload} and --data {data} disagree")
    return workload, workload


class TextTask:
    """One node's text (its shard of the training text, the shared validation windows) and its model's shape.

    Args:
        source: ``stdlib`` or ``text:PATH``.
        size: the model's size (``small`` or ``tiny``).
        index, count: this node's shard (None: all the training text).
    """

    def __init__(self, source: str, size: str, index: int | None = None, count: int = 1) -> None:
        if size not in charlm.SIZES:
            raise ValueError(f"charlm model must be one of {', '.join(SIZES)}, got {size!r}")
        self.source = source
        self.size = size
        self.config = charlm.SIZES[size]
        text = charlm.load(source)  # FileNotFoundError or ValueError name the file
        self.train = torch.from_numpy(charlm.shard(text.train, index, count) if index is not None else text.train)
        self.valid_x, self.valid_y = charlm.validation_windows(text.valid, self.config.context, EVAL_WINDOWS)
        self.valid_chars = len(text.valid)

    @property
    def name(self) -> str:
        return f"charlm ({self.source})"

    def steps_per_epoch(self, batch_size: int) -> int:
        return charlm.windows_per_epoch(len(self.train), self.config.context) // batch_size

    def batches(self, batch_size: int, generator: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return charlm.batches(self.train, batch_size, self.config.context, generator)

    def build(self) -> nn.Module:
        return charlm.build(self.size)

    @staticmethod
    def loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return charlm.loss(net, (x, y))

    def evaluate(
        self, net: nn.Module, device: torch.device, should_stop: Callable[[], bool] = lambda: False
    ) -> tuple[float, float] | None:
        """(next-character accuracy, validation loss in nats per character); None if stopped first."""
        if should_stop():
            return None
        loss, acc = charlm.evaluate(net, self.valid_x.to(device), self.valid_y.to(device))
        return acc, loss

    def checkpoint(self, net: nn.Module) -> dict:
        """What a node saves at its end, in the keys evaluate.py reads."""
        return {
            "model": f"charlm-{self.size}",
            "width": self.config.dim,
            "data": self.source,
            "in_channels": 0,
            "num_classes": self.config.vocab,
            "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
        }


def is_charlm(checkpoint: dict) -> bool:
    return str(checkpoint.get("model", "")).startswith("charlm-")


if __name__ == "__main__":
    task = TextTask("stdlib", "small")
    print(
        f"{task.name}: {len(task.train):,} training characters, {task.valid_chars:,} validation characters "
        f"({len(task.valid_y)} windows of {task.config.context} evaluated); "
        f"{sum(p.numel() for p in task.build().parameters()):,} parameters"
    )
