"""The one workload every system trains: the example's model and data, shards, batch size and learning-rate schedule.

The model and the data come from the example (``examples/pytorch-cifar``:
``models.py``, the small pre-activation ResNet, and ``data.py``, CIFAR-10 when
prepared, else the handwritten digits shipped inside dpwa), so the comparison
trains what ``./run.sh`` trains. Those files are loaded by path under private
module names; an installed dpwa without the repository's examples refuses
with a message saying so.

What is the same for every system:

* **the model**: built from ``seed``, so every worker and every server starts
  from the same weights;
* **the data**: the training images, split into ``workers`` disjoint shards
  with the example's seeded split (gossip, all-reduce, parameter servers: worker
  i trains on shard i). The sync master hands out *segments* of the whole
  training set instead (a task is a segment; any worker may get it); every
  epoch still visits every image once;
* **the batch** per worker and step, and augmentation (the example's crops);
* **the sample budget**: ``epochs`` passes over the training set, in full batches;
* **the learning rate**: ``lr`` for a mean gradient over one step of all
  workers' batches, decaying to 0 on a cosine over the fraction of the sample
  budget trained (see each system for how it applies it);
* **the optimizer**: SGD, Nesterov momentum 0.9, weight decay 5e-4, as the example.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..systems.optim import SGDSettings

__all__ = ["EXAMPLE", "ExampleMissing", "Workload", "WorkloadSpec", "example_available"]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pytorch-cifar"
DATA_DEFAULTS = {  # (batch size, lr, epochs) per dataset; digits as the example trains 4 nodes
    "digits": (32, 0.05, 30),
    "cifar10": (128, 0.1, 30),
}


class ExampleMissing(RuntimeError):
    """The example's model and data files are not where the repository keeps them."""


def example_available() -> bool:
    return (EXAMPLE / "models.py").is_file() and (EXAMPLE / "data.py").is_file()


def _load_example(name: str) -> ModuleType:
    module_name = f"dpwa_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = EXAMPLE / f"{name}.py"
    if not path.is_file():
        raise ExampleMissing(
            f"{path} not found: python -m dpwa.compare trains the example's model and data, so it runs from a "
            "checkout of the dpwa repository (examples/pytorch-cifar next to the dpwa package)"
        )
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class WorkloadSpec:
    """What every system trains, and how. JSON-able: it travels to every worker process."""

    data: str  # digits or cifar10
    data_dir: str  # the CIFAR-10 batches folder
    workers: int
    epochs: int
    batch_size: int  # per worker and step
    lr: float  # peak, for the mean gradient of one step of every worker
    seed: int = 0
    model: str = "small"
    width: int = 16
    momentum: float = 0.9
    weight_decay: float = 5e-4
    segment_batches: int = 4  # minibatches in one sync-master task
    straggler: float = 1.0  # the last worker is this many times slower per step (1: none)
    eval_points: int = 80  # about how many points each accuracy curve has

    def __post_init__(self) -> None:
        checks = [
            (self.data in DATA_DEFAULTS, f"data must be one of {', '.join(DATA_DEFAULTS)}, got {self.data!r}"),
            (1 <= self.workers <= 64, f"workers must be in 1..64, got {self.workers}"),
            (1 <= self.epochs <= 10_000, f"epochs must be in 1..10000, got {self.epochs}"),
            (1 <= self.batch_size <= 4096, f"batch_size must be in 1..4096, got {self.batch_size}"),
            (0 < self.lr <= 10, f"lr must be in (0, 10], got {self.lr}"),
            (1 <= self.segment_batches <= 1024, f"segment_batches must be in 1..1024, got {self.segment_batches}"),
            (1 <= self.straggler <= 100, f"straggler must be in [1, 100], got {self.straggler}"),
            (2 <= self.eval_points <= 1000, f"eval_points must be in 2..1000, got {self.eval_points}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def settings(self) -> SGDSettings:
        return SGDSettings(lr=self.lr, momentum=self.momentum, nesterov=True, weight_decay=self.weight_decay)

    def lr_at(self, fraction: float) -> float:
        """The learning rate once `fraction` of the sample budget was trained: a cosine from lr to 0."""
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(max(fraction, 0.0), 1.0)))


class Workload:
    """The workload of a :class:`WorkloadSpec` in this process: data loaded, model buildable.

    Raises :class:`ExampleMissing` without the example's files, and the
    example's own errors (FileNotFoundError, ValueError) for missing data.
    """

    def __init__(self, spec: WorkloadSpec) -> None:
        import torch

        self.spec = spec
        self._torch = torch
        self.datasets = _load_example("data")
        self.models = _load_example("models")
        self.data = self.datasets.load(spec.data, Path(spec.data_dir))
        self.shards = [self.data.shard(i, spec.workers, seed=spec.seed) for i in range(spec.workers)]
        self.steps_per_epoch = [len(s.train_y) // spec.batch_size for s in self.shards]
        if min(self.steps_per_epoch) < 1:
            raise ValueError(
                f"{spec.data}: a shard of {min(len(s.train_y) for s in self.shards)} images is smaller than "
                f"one batch of {spec.batch_size}; use fewer workers or a smaller batch"
            )
        self.segment_size = spec.batch_size * spec.segment_batches
        self.segments_per_epoch = len(self.data.train_y) // self.segment_size
        if self.segments_per_epoch < 1:
            raise ValueError(f"{spec.data}: fewer training images than one sync task of {self.segment_size}")

    # ----------------------------------------------------------------- model

    def build_model(self) -> Any:
        """The model, with the same initial weights in every process."""
        self._torch.manual_seed(self.spec.seed)
        return self.models.build(self.spec.model, self.data.in_channels, self.data.num_classes, self.spec.width)

    def loss(self, module: Any, batch: tuple[Any, Any]) -> Any:
        x, y = batch
        return self._torch.nn.functional.cross_entropy(module(x), y)

    # ----------------------------------------------------------------- budgets

    def local_steps(self, worker: int) -> int:
        """Steps worker `worker` takes over the whole run (gossip, all-reduce, parameter servers)."""
        return self.spec.epochs * self.steps_per_epoch[worker]

    @property
    def total_samples(self) -> int:
        """The sample budget of the whole run (every worker's steps, full batches)."""
        return sum(self.local_steps(i) for i in range(self.spec.workers)) * self.spec.batch_size

    @property
    def eval_every_samples(self) -> int:
        """Global samples between two points of an accuracy curve."""
        return max(self.spec.batch_size, self.total_samples // self.spec.eval_points)

    def snapshot_stride(self) -> int:
        """Local steps between two snapshots of a worker (so the cluster snapshots every eval_every_samples)."""
        return max(1, round(self.eval_every_samples / (self.spec.workers * self.spec.batch_size)))

    # ----------------------------------------------------------------- data

    def batches(self, worker: int, epoch: int) -> Any:
        """Worker `worker`'s minibatches of one epoch of its shard: shuffled, augmented, full."""
        generator = self._torch.Generator().manual_seed(self.spec.seed * 1_000_003 + epoch * 1009 + worker + 1)
        return self.datasets.batches(self.shards[worker], self.spec.batch_size, generator)

    def sync_segments(self) -> tuple[int, int]:
        """(epochs, segments per epoch) of the sync master's tasks."""
        return self.spec.epochs, self.segments_per_epoch

    def segment_batches(self, epoch: int, segment: int) -> list[tuple[Any, Any]]:
        """The minibatches of sync task (epoch, segment): a slice of that epoch's seeded order of every image."""
        torch = self._torch
        if not 0 <= segment < self.segments_per_epoch or not 0 <= epoch < self.spec.epochs:
            raise ValueError(f"no segment {segment} of epoch {epoch}")
        order = torch.randperm(len(self.data.train_y), generator=torch.Generator().manual_seed(self.spec.seed + epoch))
        index = order[segment * self.segment_size : (segment + 1) * self.segment_size]
        generator = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + epoch * 100_003 + segment)
        out = []
        for start in range(0, len(index), self.spec.batch_size):
            part = index[start : start + self.spec.batch_size]
            x = self.data.normalize(self.data.train_x[part])
            x = self.datasets.augment(x, self.data.crop_padding, self.data.flip, generator)
            out.append((x, self.data.train_y[part]))
        return out

    # ----------------------------------------------------------------- evaluation

    def evaluator(self) -> Evaluator:
        return Evaluator(self)


class Evaluator:
    """Test accuracy and loss of flat model states (parameters then buffers, see :class:`ModuleView`)."""

    def __init__(self, workload: Workload) -> None:
        from ..systems.layout import ModuleView

        self.workload = workload
        self.view = ModuleView(workload.build_model())

    def __call__(self, state: np.ndarray) -> tuple[float, float]:
        torch = self.workload._torch
        data = self.workload.data
        self.view.load_state(state)
        net = self.view.module
        net.eval()
        correct, loss_sum = 0, 0.0
        with torch.no_grad():
            for x, y in self.workload.datasets.batches(data, 500, generator=None, train=False):
                logits = net(x)
                loss_sum += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
                correct += (logits.argmax(1) == y).sum().item()
        n = len(data.test_y)
        return correct / n, loss_sum / n
