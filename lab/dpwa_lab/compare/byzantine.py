"""Byzantine gossip workers for ``python -m dpwa.compare --byzantine K --attack offset|flip``.

The last K workers of every gossip system (w{N-K} .. w{N-1}) train as the
others do, but every snapshot they publish (what a peer fetches, in mode pull,
or exchanges with, in mode symmetric) is wrong. For each parameter tensor p
(buffers, such as BatchNorm's running statistics, are published as they are):

* ``offset``: ``p + 10 * std(p)``: every element shifted by ten standard
  deviations of its tensor's elements (``std`` over the tensor, dividing by
  the element count), a plausible-looking value far from the others';
* ``flip``: ``-p``.

:func:`published_wrong` applies the attack to the module's parameters in place
for the moment a snapshot is copied, and restores the saved values exactly
afterwards, so the node's own training (its forward and backward passes, its
optimizer steps, the blends it applies) runs on its true parameters. The
gossip role (:mod:`.roles.gossip`) wraps the node's publication with it, so
every snapshot the node publishes while it trains and lingers is wrong: the
one at each ``update_send``, the one mode symmetric publishes after an
exchange it applied, and those it publishes while lingering. (The node's
first snapshot, published when it starts, before the start gate, is its true
initial model.) The rule's own-snapshot bookkeeping uses the published
snapshot, as it would on an honest node: a delta blend moves a Byzantine node
by ``f (s_peer - s_own)``, with ``s_own`` the wrong snapshot it published.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["ATTACKS", "OFFSET_STDS", "attack_", "byzantine_names", "published_wrong"]

OFFSET_STDS = 10.0  # offset: how many of its tensor's standard deviations every element is shifted by
ATTACKS = {
    "offset": f"each parameter tensor p published as p + {OFFSET_STDS:g} * std(p) (std over the tensor's elements)",
    "flip": "each parameter tensor p published as -p",
}


def byzantine_names(workers: int, count: int) -> list[str]:
    """The Byzantine workers' names: the last `count` of w0 .. w{workers - 1}."""
    if not 0 <= count < workers:
        raise ValueError(f"byzantine workers must be in [0, {workers}), got {count}")
    return [f"w{i}" for i in range(workers - count, workers)]


def attack_(tensor: torch.Tensor, attack: str) -> None:
    """Change `tensor` in place into what a Byzantine worker publishes for it (no autograd)."""
    import torch

    with torch.no_grad():
        if attack == "offset":
            std = tensor.double().std(correction=0).item() if tensor.numel() else 0.0
            tensor.add_(OFFSET_STDS * std)
        elif attack == "flip":
            tensor.neg_()
        else:
            raise ValueError(f"unknown attack {attack!r}; choose from {', '.join(ATTACKS)}")


@contextmanager
def published_wrong(module: nn.Module, attack: str) -> Iterator[None]:
    """Within the block, `module`'s parameters hold what a Byzantine worker publishes; afterwards they hold
    exactly the values they held before (saved and copied back, under ``torch.no_grad()``)."""
    import torch

    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; choose from {', '.join(ATTACKS)}")
    params = list(module.parameters())
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        for p in params:
            attack_(p, attack)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)
