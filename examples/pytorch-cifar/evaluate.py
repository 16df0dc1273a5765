"""Test-set evaluation: of one model during training, or of the parameter average of a run's nodes.

    .venv/bin/python examples/pytorch-cifar/evaluate.py runs/latest
    .venv/bin/python examples/pytorch-cifar/evaluate.py runs/latest/models/w1.pt

The first averages every ``models/*.pt`` of the run folder (what each node
saved at its end) and evaluates that one model; the second evaluates the files
given. It prints one JSON line: ``{"models": 2, "data": "digits", "test_acc":
0.97, "test_loss": 0.1}``; for charlm checkpoints ``test_acc`` is the
next-character accuracy and ``test_loss`` the validation loss (nats per
character), also given as ``val_loss`` and ``bits_per_char``. Files are read
with ``torch.load(weights_only=True)``. The mean is dpwa's
(``dpwa.cluster.average.average_state_dicts``); ``python -m dpwa average RUN_DIR
-o mean.pt`` writes the mean of a run's latest complete checkpoint instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import data as datasets
import models
import torch
import torch.nn.functional as F
from torch import nn

from dpwa.cluster.average import average_state_dicts

CHECKPOINT_KEYS = ("model", "width", "data", "in_channels", "num_classes", "state_dict")


@torch.no_grad()
def evaluate(
    net: nn.Module,
    data: datasets.Dataset,
    device: torch.device,
    batch_size: int = 500,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[float, float] | None:
    """(accuracy, mean cross-entropy) on the test images; None if `should_stop` turned true meanwhile."""
    was_training = net.training
    net.eval()
    correct, loss_sum = 0, 0.0
    try:
        for x, y in datasets.batches(data, batch_size, generator=None, train=False):
            if should_stop():
                return None
            x, y = x.to(device), y.to(device)
            logits = net(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
    finally:
        net.train(was_training)
    n = len(data.test_y)
    return correct / n, loss_sum / n


def checkpoint(net: nn.Module, model: str, width: int, data: datasets.Dataset) -> dict:
    """What a node saves at its end: the model's name and shape, and its weights on the CPU."""
    return {
        "model": model,
        "width": width,
        "data": data.name,
        "in_channels": data.in_channels,
        "num_classes": data.num_classes,
        "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
    }


def load_checkpoint(path: Path) -> dict:
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch.load raises many kinds (UnpicklingError, struct.error, ...) on a bad file
        raise ValueError(f"{path}: cannot read the checkpoint: {type(exc).__name__}: {exc}") from exc
    if not isinstance(saved, dict) or any(key not in saved for key in CHECKPOINT_KEYS):
        raise ValueError(f"{path}: not a checkpoint of train.py (expected keys {', '.join(CHECKPOINT_KEYS)})")
    return saved


def average_checkpoints(paths: list[Path]) -> dict:
    """One checkpoint whose floating-point tensors are the mean of those in `paths`; the rest come from the first.

    The mean is dpwa's (:func:`dpwa.cluster.average.average_state_dicts`): summed in float64, refused with
    a ValueError naming the file when tensor names, shapes or dtypes differ or a value is NaN or Inf."""
    if not paths:
        raise ValueError("no checkpoints to average")
    saved = [load_checkpoint(p) for p in paths]
    first = saved[0]
    for path, other in zip(paths[1:], saved[1:], strict=True):
        mismatch = [k for k in CHECKPOINT_KEYS[:-1] if other[k] != first[k]]
        if mismatch:
            raise ValueError(f"{path}: a different model than {paths[0]} ({', '.join(mismatch)})")
    state = average_state_dicts({str(p): s["state_dict"] for p, s in zip(paths, saved, strict=True)})
    return {**first, "state_dict": state}


def build_from(saved: dict) -> nn.Module:
    if saved["model"].startswith("charlm-"):
        from dpwa_lab.workloads import charlm

        net: nn.Module = charlm.build(saved["model"][len("charlm-") :])
        net.load_state_dict(saved["state_dict"])
        return net
    net = models.build(saved["model"], saved["in_channels"], saved["num_classes"], saved["width"])
    net.load_state_dict(saved["state_dict"])
    return net


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Evaluate the parameter average of a run's nodes on the test set.")
    parser.add_argument("paths", nargs="+", type=Path, help="a run folder (uses its models/*.pt) or checkpoint files")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=datasets.DEFAULT_CIFAR_DIR,
        help="CIFAR-10 batches folder (default: %(default)s)",
    )
    parser.add_argument("--device", default="auto", help="auto (a GPU when available), cpu, cuda or cuda:N")
    args = parser.parse_args(argv)
    files: list[Path] = []
    for path in args.paths:
        if not path.exists():
            print(f"evaluate.py: {path}: no such run folder or checkpoint", file=sys.stderr)
            return 1
        files += sorted((path / "models").glob("*.pt")) if path.is_dir() else [path]
    try:
        if not files:
            raise ValueError(f"{', '.join(map(str, args.paths))}: no models/*.pt found; did the nodes finish?")
        saved = average_checkpoints(files)
        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(args.device)
        if saved["model"].startswith("charlm-"):
            import text as texts

            task = texts.TextTask(saved["data"], saved["model"][len("charlm-") :])
            result = task.evaluate(build_from(saved).to(device), device)
            assert result is not None
            acc, loss = result
            extra = {"val_loss": loss, "bits_per_char": loss / math.log(2)}
        else:
            data = datasets.load(saved["data"], args.data_dir)
            result = evaluate(build_from(saved).to(device), data, device)
            assert result is not None  # None only when should_stop, which is never here
            acc, loss = result
            extra = {}
    except (ValueError, FileNotFoundError) as exc:
        print(f"evaluate.py: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"models": len(files), "data": saved["data"], "test_acc": acc, "test_loss": loss, **extra}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
