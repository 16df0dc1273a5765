"""The mixing layer's objects a configuration names: the interpolation, the blend rule, the pairing.

:mod:`dpwa.mixing` is pure math and knows nothing of configuration files; this is
where a :class:`~dpwa.config.Config`'s words become its objects.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import Config
from ..mixing import pairing
from ..mixing.interpolation import ClockWeighted, Constant, Interpolation, LossWeighted
from ..mixing.rules import Blend, DeltaBlend, StateBlend

__all__ = ["blend_of", "interpolation_of", "pairing_of"]


def interpolation_of(config: Config) -> Interpolation:
    """The interpolation named by ``config.interpolation``."""
    if config.interpolation == "constant":
        return Constant(config.constant.value)
    if config.interpolation == "clock":
        return ClockWeighted()
    if config.interpolation == "loss":
        return LossWeighted()
    raise ValueError(f"unknown interpolation {config.interpolation!r}")


def blend_of(config: Config) -> Blend:
    """The blend rule named by ``config.blend``."""
    return DeltaBlend() if config.blend == "delta" else StateBlend()


def pairing_of(config: Config, name: str) -> Callable[[int], str | None] | None:
    """pairing: hypercube: round -> our partner, or None when the partner starts the exchange (random: None)."""
    if config.pairing != "hypercube":
        return None
    order = [spec.name for spec in config.nodes]
    index, n, mode = order.index(name), len(order), config.mode

    def partner(round_: int) -> str | None:
        other = pairing.hypercube_partner(index, n, round_)
        return order[other] if pairing.initiates(index, other, mode) else None

    return partner
