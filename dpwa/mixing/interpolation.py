"""Interpolation: how much of a peer's parameters to take in.

After an exchange, a node blends ``params = f * peer + (1 - f) * params``. The
strategies here decide ``f`` from numbers only (clocks and losses), so they are
tested without sockets or tensors:

* :class:`Constant`: ``f = value``;
* :class:`ClockWeighted`: ``f = peer_clock / (clock + peer_clock)``: the peer
  that has trained on more samples pulls harder;
* :class:`LossWeighted`: ``f = loss / (loss + peer_loss)``: the peer with the
  lower loss pulls harder.

:func:`damp_by_divergence` then scales ``f`` down once a node's own loss falls
below the divergence threshold, and :func:`blend_clock` gives the clock after
a blend. Every factor returned here lies in [0, 1].
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TypeGuard

__all__ = [
    "ClockWeighted",
    "Constant",
    "Interpolation",
    "LossWeighted",
    "blend_clock",
    "damp_by_divergence",
]


def _known(x: float | None) -> TypeGuard[float]:
    return x is not None and math.isfinite(x) and x >= 0.0


def _share(mine: float, theirs: float) -> float:
    """theirs / (mine + theirs), with 0/0 read as an even split."""
    total = mine + theirs
    return 0.5 if total == 0.0 else theirs / total


class Interpolation(ABC):
    """Chooses the factor f given both sides' clocks and losses."""

    name: str

    @abstractmethod
    def factor(self, clock: float, peer_clock: float, loss: float | None, peer_loss: float | None) -> float:
        """The weight of the peer's parameters, in [0, 1]."""


class Constant(Interpolation):
    """f = value, whatever the clocks and losses."""

    name = "constant"

    def __init__(self, value: float = 0.5) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"constant interpolation value must be in [0, 1], got {value!r}")
        self.value = float(value)

    def factor(self, clock, peer_clock, loss, peer_loss) -> float:
        return self.value


class ClockWeighted(Interpolation):
    """f = peer_clock / (clock + peer_clock); two fresh nodes (0/0) split evenly."""

    name = "clock"

    def factor(self, clock, peer_clock, loss, peer_loss) -> float:
        if not (_known(clock) and _known(peer_clock)):
            return 0.5
        return _share(clock, peer_clock)


class LossWeighted(Interpolation):
    """f = loss / (loss + peer_loss): a peer whose loss is lower than ours pulls harder.

    0/0 gives 0.5. A loss that is unknown (None), negative or not finite on
    either side also gives 0.5: the rule is only meaningful for losses >= 0.
    """

    name = "loss"

    def factor(self, clock, peer_clock, loss, peer_loss) -> float:
        if not (_known(loss) and _known(peer_loss)):
            return 0.5
        return _share(peer_loss, loss)


def damp_by_divergence(f: float, loss: float | None, threshold: float) -> float:
    """Scale f by loss / threshold when our own loss is below the threshold.

    A node whose loss is already low takes less from its peers, so a peer
    that diverged cannot drag a converged node far. ``threshold = 0`` disables
    the rule, and so does an unknown loss.
    """
    if threshold > 0.0 and _known(loss) and loss < threshold:
        return f * loss / threshold
    return f


def blend_clock(f: float, clock: float, peer_clock: float) -> float:
    """The clock after a blend: the same interpolation as the parameters."""
    return f * peer_clock + (1.0 - f) * clock
