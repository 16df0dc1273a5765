"""How long and how fast each node trains, per dataset and number of nodes; and the warning when too short.

The rule for many nodes (digits; measured in docs/operations.md): the default
learning rate was tuned for 2 nodes, and it grows linearly with the number of
nodes (``lr * nodes / 2``, at most ``MAX_LR_SCALE`` times), with a linear warm-up
over the first epoch (at most a tenth of the steps), then the cosine decay.
With n nodes each node trains on 1/n of the data, so 20 epochs take each node
n/2 times fewer steps; the larger steps make up for it. Every node still takes
at least ``min_steps`` steps (more epochs when the shards are tiny).

Measured on digits: 8 nodes reached 95.8% in 20 epochs with 2 nodes' learning
rate, and 99.4% with 4 times it. The rule is off for CIFAR-10 (not measured
here: the data is not on the test machines); an explicit ``--lr`` is used as
given, on every node.

An explicit ``--epochs`` that gives a node fewer than ``min_steps`` steps is
honoured, with a warning that names the numbers (8 nodes, --epochs 5: 25 steps
a node, and 55% test accuracy, 35% with the 2-node rate).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "DEFAULTS",
    "MAX_LR_SCALE",
    "default_epochs",
    "learning_rate",
    "warmup_steps",
    "lr_factor",
    "few_steps_warning",
]

REFERENCE_NODES = 2  # the defaults' learning rates were tuned for this many nodes
MAX_LR_SCALE = 8.0  # the default learning rate grows with the nodes up to this many times
# Per dataset: epochs, the steps each node needs (at least), batch size, peak learning rate (for 2 nodes),
# and whether that learning rate scales with the number of nodes.
DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {"epochs": 20, "min_steps": 100, "batch_size": 32, "lr": 0.05, "scale_lr": True},
    "cifar10": {"epochs": 30, "min_steps": 0, "batch_size": 128, "lr": 0.1, "scale_lr": False},
    # charlm: an "epoch" is 50 steps of random windows of the node's shard (a whole pass is 500 and more);
    # it trains with AdamW (betas 0.9, 0.95), as python -m dpwa.compare does: SGD stalls on the transformer
    "charlm": {
        "epochs": 6,
        "min_steps": 0,
        "batch_size": 32,
        "lr": 0.01,
        "scale_lr": False,
        "steps_per_epoch": 50,
        "weight_decay": 0.01,
    },
}


def default_epochs(data: str, full_epoch: int) -> int:
    """The epochs a node trains when --epochs is not given: enough for min_steps steps of `full_epoch` each."""
    defaults = DEFAULTS[data]
    return max(defaults["epochs"], math.ceil(defaults["min_steps"] / max(1, full_epoch)))


def learning_rate(data: str, nodes: int, lr: float | None = None) -> tuple[float, float]:
    """(peak learning rate, how many times the 2-node default it is): `lr` as given, or the rule's."""
    if lr is not None:
        return lr, 1.0
    defaults = DEFAULTS[data]
    scale = min(MAX_LR_SCALE, max(1.0, nodes / REFERENCE_NODES)) if defaults["scale_lr"] else 1.0
    return defaults["lr"] * scale, scale


def warmup_steps(scale: float, steps_per_epoch: int, total_steps: int) -> int:
    """Mode of linear warm-up: the first epoch (at most a tenth of all steps) when the rate was scaled up."""
    if scale <= 1.0:
        return 0
    return max(1, min(steps_per_epoch, total_steps // 10))


def lr_factor(step: int, total_steps: int, warmup: int) -> float:
    """The learning rate at `step` as a fraction of the peak: linear warm-up, then cosine decay to 0."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    return cosine * min(1.0, (step + 1) / warmup) if warmup else cosine


def few_steps_warning(data: str, nodes: int, shard: int, batch_size: int, steps: int, epochs: int) -> str | None:
    """A warning naming the numbers when `epochs` of `steps` steps are fewer than `data` needs; else None.

    `shard` is a node's number of training images, `steps` its steps per epoch.
    """
    needed = DEFAULTS[data]["min_steps"]
    if epochs * steps >= needed:
        return None
    enough = math.ceil(needed / max(1, steps))
    return (
        f"{epochs} epochs of {steps} steps (a shard of {shard} {data} images in batches of {batch_size}, "
        f"{nodes} node{'s' if nodes != 1 else ''}) give each node {epochs * steps} steps, and {data} needs at "
        f"least {needed} to train well: expect a low accuracy. Give --epochs {enough} or more, leave --epochs "
        "out, or use fewer nodes"
    )
