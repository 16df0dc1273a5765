"""The workload every system trains: model, data, shards, batch size, budget, learning-rate schedule, evaluation.

Two kinds (``WorkloadSpec.workload``):

* ``image``: the example's model and data (``examples/pytorch-cifar``:
  ``models.py``, the small pre-activation ResNet, and ``data.py``, CIFAR-10 when
  prepared, else the handwritten digits shipped with dpwa's lab), so the comparison
  trains what ``./run.sh`` trains. Those files are loaded by path under
  private module names; an installed dpwa without the repository's examples
  refuses with a message saying so. The metric is test accuracy.
* ``charlm``: the character-level transformer of :mod:`dpwa_lab.workloads.charlm`
  on the standard library's source (``stdlib``) or a text file (``text:PATH``).
  It is part of the package: it needs no checkout. The metric is validation
  loss in nats per character (and bits per character); a sample is one window
  of ``context`` characters.

What is the same for every system:

* **the model**: built from ``seed``, so every worker and every server starts
  from the same weights;
* **the data**: the training set, split into ``workers`` disjoint shards
  (gossip, all-reduce, DiLoCo, parameter servers: worker i trains on shard i).
  The sync master hands out *segments* of the whole training set instead (a
  task is a segment; any worker may get it);
* **the batch** per worker and step, and augmentation (the example's crops);
* **the sample budget**: ``steps`` steps per worker, or else ``epochs`` passes
  over each worker's shard, in full batches;
* **the learning rate**: ``lr`` for a mean gradient over one step of all
  workers' batches, decaying to 0 on a cosine over the fraction of the sample
  budget trained (see each system for how it applies it), after a linear
  warmup from lr / 10 over the first ``warmup`` of it (charlm: 10%; images: none);
* **the optimizer**: images: SGD, Nesterov momentum 0.9, weight decay 5e-4, as
  the example; charlm: AdamW, betas (0.9, 0.95), decoupled weight decay 0.01
  (SGD stalls on the transformer: with any batch size it ended near 2.5 nats
  per character after 150 steps, where AdamW went on to 2.28 with the
  all-reduce batch and 2.36 with one worker's).

Where the workers train (``device``): ``cpu``, or ``cuda``, where worker i
trains on GPU i modulo the GPUs this machine has (:meth:`Workload.device_of`).
Batches are made on the CPU and moved to the model's device by
:meth:`Workload.loss`; servers, masters and the evaluation stay on the CPU.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..systems.optim import ALGORITHMS, SGDSettings
from ..workloads import images

__all__ = [
    "CHARLM_DEFAULTS",
    "DATA_DEFAULTS",
    "CHECKOUT_CIFAR_DIR",
    "Workload",
    "WorkloadSpec",
    "load_workload",
]

# where a checkout keeps CIFAR-10 (examples/pytorch-cifar/prepare.sh); from an install, give --data-dir
CHECKOUT_CIFAR_DIR = Path(__file__).resolve().parents[3] / "examples" / "pytorch-cifar" / "data" / "cifar-10-batches-py"
DATA_DEFAULTS = {  # (batch size, lr, epochs) per image dataset; digits as the example trains 4 nodes
    "digits": (32, 0.05, 30),
    "cifar10": (128, 0.1, 30),
}
KINDS = ("image", "charlm")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class CharLMDefaults:
    """charlm's defaults in the comparison, chosen so that the slow-link run of docs/comparison.md ends within 10 minutes."""

    batch_size: int = 32  # sequences of 128 characters per worker and step
    optimizer: str = "adamw"
    lr: float = 0.01  # of 0.003, 0.006, 0.01: the best after 150 steps, with one worker's batch and with four's
    weight_decay: float = 0.01  # decoupled (AdamW)
    steps: int = 150  # per worker
    eval_points: int = 30  # each evaluation is a forward pass over eval_windows windows
    eval_windows: int = 64  # 8,192 characters spread over the validation text
    warmup: float = 0.05  # of the budget
    target_loss: float = 2.4  # nats per character: all-reduce reached it at half its run (9,600 of 19,200 samples)


CHARLM_DEFAULTS = CharLMDefaults()


def _charlm_data_ok(data: str) -> bool:
    return data == "stdlib" or (data.startswith("text:") and len(data) > len("text:"))


@dataclass(frozen=True)
class WorkloadSpec:
    """What every system trains, and how. JSON-able: it travels to every worker process."""

    data: str  # image: digits or cifar10; charlm: stdlib or text:PATH
    data_dir: str  # the CIFAR-10 batches folder
    workers: int
    epochs: int  # passes over each worker's shard (when steps is 0)
    batch_size: int  # per worker and step
    lr: float  # peak, for the mean gradient of one step of every worker
    seed: int = 0
    model: str = "small"  # image: small or resnet18; charlm: small or tiny
    width: int = 16
    momentum: float = 0.9  # sgd
    weight_decay: float = 5e-4
    optimizer: str = "sgd"  # sgd (Nesterov momentum) or adamw (betas 0.9, 0.95)
    segment_batches: int = 4  # minibatches in one sync-master task
    straggler: float = 1.0  # the last worker is this many times slower per step (1: none)
    eval_points: int = 80  # about how many points each curve has
    workload: str = "image"  # image or charlm
    steps: int = 0  # per worker; 0: epochs passes over each shard
    eval_windows: int = 128  # charlm: validation windows each evaluation reads
    warmup: float = 0.0  # fraction of the budget over which lr rises linearly from lr/10 (0: none)
    device: str = "cpu"  # where workers train: cpu, or cuda (worker i on GPU i modulo the GPUs there are)

    def __post_init__(self) -> None:
        image = self.workload == "image"
        checks = [
            (self.workload in KINDS, f"workload must be one of {', '.join(KINDS)}, got {self.workload!r}"),
            (
                (self.data in DATA_DEFAULTS) if image else _charlm_data_ok(self.data),
                f"data must be one of {', '.join(DATA_DEFAULTS)} for images, stdlib or text:PATH for charlm; "
                f"got {self.data!r} for {self.workload}",
            ),
            (1 <= self.workers <= 64, f"workers must be in 1..64, got {self.workers}"),
            (1 <= self.epochs <= 10_000, f"epochs must be in 1..10000, got {self.epochs}"),
            (0 <= self.steps <= 10_000_000, f"steps must be in 0..10000000, got {self.steps}"),
            (1 <= self.batch_size <= 4096, f"batch_size must be in 1..4096, got {self.batch_size}"),
            (0 < self.lr <= 10, f"lr must be in (0, 10], got {self.lr}"),
            (1 <= self.segment_batches <= 1024, f"segment_batches must be in 1..1024, got {self.segment_batches}"),
            (1 <= self.straggler <= 100, f"straggler must be in [1, 100], got {self.straggler}"),
            (2 <= self.eval_points <= 1000, f"eval_points must be in 2..1000, got {self.eval_points}"),
            (1 <= self.eval_windows <= 100_000, f"eval_windows must be in 1..100000, got {self.eval_windows}"),
            (0 <= self.warmup < 1, f"warmup must be in [0, 1), got {self.warmup}"),
            (self.optimizer in ALGORITHMS, f"optimizer must be one of {', '.join(ALGORITHMS)}, got {self.optimizer!r}"),
            (self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}, got {self.device!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def settings(self) -> SGDSettings:
        """The optimizer every system applies (workers to their model, a master or servers to theirs)."""
        return SGDSettings(
            lr=self.lr, momentum=self.momentum, nesterov=True, weight_decay=self.weight_decay, algorithm=self.optimizer
        )

    def lr_at(self, fraction: float) -> float:
        """The learning rate once `fraction` of the sample budget was trained: a cosine from lr to 0, after a
        linear warmup from lr / 10 over the first `warmup` of the budget (if any)."""
        fraction = min(max(fraction, 0.0), 1.0)
        rate = self.lr * 0.5 * (1 + math.cos(math.pi * fraction))
        if fraction < self.warmup:
            rate *= 0.1 + 0.9 * fraction / self.warmup
        return rate


class Workload(ABC):
    """The workload of a :class:`WorkloadSpec` in this process: data loaded, model buildable, batches, budgets.

    Subclasses set ``steps_per_epoch`` (per worker: full batches in one pass
    over its shard), ``segments_per_epoch`` (sync tasks in one pass over the
    whole training set) and ``metric`` ("acc": higher is better; "loss": lower).
    """

    metric = "acc"
    steps_per_epoch: list[int]
    segments_per_epoch: int

    def __init__(self, spec: WorkloadSpec) -> None:
        import torch

        self.spec = spec
        self._torch = torch
        self.segment_size = spec.batch_size * spec.segment_batches

    def _check_sizes(self, what: str, shard_sizes: list[int], unit: str) -> None:
        if min(self.steps_per_epoch) < 1:
            raise ValueError(
                f"{what}: a shard of {min(shard_sizes)} {unit} is smaller than one batch of {self.spec.batch_size}; "
                "use fewer workers or a smaller batch"
            )
        if self.segments_per_epoch < 1:
            raise ValueError(f"{what}: fewer training {unit} than one sync task of {self.segment_size}")

    # ----------------------------------------------------------------- what each kind defines

    @abstractmethod
    def build_model(self) -> Any:
        """The model, with the same initial weights in every process, on the CPU."""

    @abstractmethod
    def _loss(self, module: Any, batch: tuple[Any, Any]) -> Any:
        """The training loss of `module` on `batch`, both on one device (a scalar tensor)."""

    def loss(self, module: Any, batch: tuple[Any, Any]) -> Any:
        """The training loss of `module` on `batch` (a scalar tensor), the batch moved to the module's device."""
        device = next(module.parameters()).device
        if device.type != "cpu":
            batch = (batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True))
        return self._loss(module, batch)

    def device_of(self, worker: int) -> Any:
        """The device worker `worker` trains on: the CPU, or with ``device: cuda`` GPU `worker` modulo the GPUs
        there are. RuntimeError if CUDA was asked for and this torch or machine has none."""
        torch = self._torch
        if self.spec.device == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device cuda: torch {torch.__version__} sees no GPU here "
                f"(built with CUDA {torch.version.cuda or 'none'}); run with --device cpu"
            )
        return torch.device("cuda", worker % torch.cuda.device_count())

    def worker_model(self, worker: int) -> Any:
        """The model worker `worker` trains: :meth:`build_model` on :meth:`device_of` (the GPU made current)."""
        device = self.device_of(worker)
        if device.type == "cuda":
            self._torch.cuda.set_device(device)
        return self.build_model().to(device)

    @abstractmethod
    def epoch_batches(self, worker: int, epoch: int) -> Iterator[tuple[Any, Any]]:
        """Worker `worker`'s minibatches of one pass over its shard: shuffled, full."""

    @abstractmethod
    def pass_segment(self, pass_: int, index: int) -> list[tuple[Any, Any]]:
        """The minibatches of segment `index` of pass `pass_` over the whole training set (a seeded order)."""

    @abstractmethod
    def evaluator(self) -> Any:
        """A callable: flat model state -> (accuracy, loss) on the test or validation set."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The data's sizes, for the report."""

    @property
    @abstractmethod
    def evaluated_on(self) -> str:
        """What an evaluation reads, in words ("all 360 test images")."""

    # ----------------------------------------------------------------- budgets

    def local_steps(self, worker: int) -> int:
        """Steps worker `worker` takes over the whole run (gossip, all-reduce, DiLoCo, parameter servers)."""
        return self.spec.steps or self.spec.epochs * self.steps_per_epoch[worker]

    def lockstep_steps(self) -> int:
        """Steps every rank of a collective system takes: the fewest of any worker, so no rank waits alone."""
        return min(self.local_steps(i) for i in range(self.spec.workers))

    @property
    def total_samples(self) -> int:
        """The sample budget of the whole run (every worker's steps, full batches)."""
        return sum(self.local_steps(i) for i in range(self.spec.workers)) * self.spec.batch_size

    @property
    def eval_every_samples(self) -> int:
        """Global samples between two points of a curve."""
        return max(self.spec.batch_size, self.total_samples // self.spec.eval_points)

    def snapshot_stride(self) -> int:
        """Local steps between two snapshots of a worker (so the cluster snapshots every eval_every_samples)."""
        return max(1, round(self.eval_every_samples / (self.spec.workers * self.spec.batch_size)))

    # ----------------------------------------------------------------- data

    def train_batches(self, worker: int, steps: int | None = None) -> Iterator[tuple[Any, Any]]:
        """Worker `worker`'s minibatches of the whole run: `steps` (default: its local steps), pass after pass."""
        left = self.local_steps(worker) if steps is None else steps
        epoch = 0
        while left > 0:
            for batch in self.epoch_batches(worker, epoch):
                yield batch
                left -= 1
                if left == 0:
                    return
            epoch += 1

    def sync_segments(self) -> tuple[int, int]:
        """(epochs, segments per epoch) of the sync master's tasks: the same sample budget as the others'."""
        if not self.spec.steps:
            return self.spec.epochs, self.segments_per_epoch
        return 1, max(1, self.spec.workers * self.spec.steps // self.spec.segment_batches)

    def segment_batches(self, epoch: int, segment: int) -> list[tuple[Any, Any]]:
        """The minibatches of sync task (epoch, segment): a slice of a seeded order of the whole training set."""
        epochs, segments = self.sync_segments()
        if not 0 <= segment < segments or not 0 <= epoch < epochs:
            raise ValueError(f"no segment {segment} of epoch {epoch}")
        pass_, index = divmod(epoch * segments + segment, self.segments_per_epoch)
        return self.pass_segment(pass_, index)


def load_workload(spec: WorkloadSpec) -> Workload:
    """The workload `spec` describes, loaded in this process."""
    if spec.workload == "charlm":
        return CharLMWorkload(spec)
    return ImageWorkload(spec)


class ImageWorkload(Workload):
    """The example's ResNet on digits or CIFAR-10 (dpwa_lab.workloads.images).

    Raises FileNotFoundError or ValueError for missing or unreadable data.
    """

    def __init__(self, spec: WorkloadSpec) -> None:
        super().__init__(spec)
        self.datasets = images
        self.data = images.load(spec.data, Path(spec.data_dir))
        self.shards = [self.data.shard(i, spec.workers, seed=spec.seed) for i in range(spec.workers)]
        self.steps_per_epoch = [len(s.train_y) // spec.batch_size for s in self.shards]
        self.segments_per_epoch = len(self.data.train_y) // self.segment_size
        self._check_sizes(spec.data, [len(s.train_y) for s in self.shards], "images")

    def build_model(self) -> Any:
        self._torch.manual_seed(self.spec.seed)
        return images.build(self.spec.model, self.data.in_channels, self.data.num_classes, self.spec.width)

    def _loss(self, module: Any, batch: tuple[Any, Any]) -> Any:
        x, y = batch
        return self._torch.nn.functional.cross_entropy(module(x), y)

    def epoch_batches(self, worker: int, epoch: int) -> Iterator[tuple[Any, Any]]:
        generator = self._torch.Generator().manual_seed(self.spec.seed * 1_000_003 + epoch * 1009 + worker + 1)
        return self.datasets.batches(self.shards[worker], self.spec.batch_size, generator)

    def pass_segment(self, pass_: int, index: int) -> list[tuple[Any, Any]]:
        torch = self._torch
        order = torch.randperm(len(self.data.train_y), generator=torch.Generator().manual_seed(self.spec.seed + pass_))
        part = order[index * self.segment_size : (index + 1) * self.segment_size]
        generator = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + pass_ * 100_003 + index)
        out = []
        for start in range(0, len(part), self.spec.batch_size):
            chosen = part[start : start + self.spec.batch_size]
            x = self.data.normalize(self.data.train_x[chosen])
            x = self.datasets.augment(x, self.data.crop_padding, self.data.flip, generator)
            out.append((x, self.data.train_y[chosen]))
        return out

    def evaluator(self) -> ImageEvaluator:
        return ImageEvaluator(self)

    def describe(self) -> dict[str, Any]:
        return {"train_images": len(self.data.train_y), "test_images": len(self.data.test_y)}

    @property
    def evaluated_on(self) -> str:
        return f"all {len(self.data.test_y)} test images"


class ImageEvaluator:
    """Test accuracy and loss of flat model states (parameters then buffers, see :class:`ModuleView`)."""

    def __init__(self, workload: ImageWorkload) -> None:
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


class CharLMWorkload(Workload):
    """The character-level transformer of :mod:`dpwa_lab.workloads.charlm` on the stdlib or a text file."""

    metric = "loss"

    def __init__(self, spec: WorkloadSpec) -> None:
        from ..workloads import charlm

        super().__init__(spec)
        self.charlm = charlm
        if spec.model not in charlm.SIZES:
            raise ValueError(f"charlm model must be one of {', '.join(charlm.SIZES)}, got {spec.model!r}")
        self.config = charlm.SIZES[spec.model]
        self.text = charlm.load(spec.data)
        context = self.config.context
        self.shards = [
            self._torch.from_numpy(charlm.shard(self.text.train, i, spec.workers)) for i in range(spec.workers)
        ]
        self.steps_per_epoch = [charlm.windows_per_epoch(len(s), context) // spec.batch_size for s in self.shards]
        self.segments_per_epoch = charlm.windows_per_epoch(len(self.text.train), context) // self.segment_size
        self._check_sizes(self.text.source, [len(s) for s in self.shards], "characters")
        self.valid_x, self.valid_y = charlm.validation_windows(self.text.valid, context, spec.eval_windows)

    def build_model(self) -> Any:
        return self.charlm.build(self.spec.model, seed=self.spec.seed)

    def _loss(self, module: Any, batch: tuple[Any, Any]) -> Any:
        return self.charlm.loss(module, batch)

    def epoch_batches(self, worker: int, epoch: int) -> Iterator[tuple[Any, Any]]:
        generator = self._torch.Generator().manual_seed(self.spec.seed * 1_000_003 + epoch * 1009 + worker + 1)
        return self.charlm.batches(self.shards[worker], self.spec.batch_size, self.config.context, generator)

    def pass_segment(self, pass_: int, index: int) -> list[tuple[Any, Any]]:
        context = self.config.context
        generator = self._torch.Generator().manual_seed(self.spec.seed + pass_)
        offset, order = self.charlm.epoch_order(len(self.text.train), context, generator)
        part = order[index * self.segment_size : (index + 1) * self.segment_size]
        out = []
        for start in range(0, len(part), self.spec.batch_size):
            starts = offset + part[start : start + self.spec.batch_size] * context
            out.append(self.charlm.windows(self.text.train, starts, context))
        return out

    def evaluator(self) -> CharLMEvaluator:
        return CharLMEvaluator(self)

    def describe(self) -> dict[str, Any]:
        return {
            "text": self.text.source,
            "train_chars": len(self.text.train),
            "valid_chars": len(self.text.valid),
            "train_files": self.text.train_files,
            "valid_files": self.text.valid_files,
            "context": self.config.context,
            "valid_windows_evaluated": len(self.valid_y),
            "model_config": asdict(self.config),
        }

    @property
    def evaluated_on(self) -> str:
        n = len(self.valid_y)
        return f"{n} validation windows of {self.config.context} characters ({n * self.config.context:,} characters)"


class CharLMEvaluator:
    """Next-character accuracy and validation loss (nats per character) of flat model states."""

    def __init__(self, workload: CharLMWorkload) -> None:
        from ..systems.layout import ModuleView

        self.workload = workload
        self.view = ModuleView(workload.build_model())

    def __call__(self, state: np.ndarray) -> tuple[float, float]:
        self.view.load_state(state)
        loss, acc = self.workload.charlm.evaluate(self.view.module, self.workload.valid_x, self.workload.valid_y)
        return acc, loss
