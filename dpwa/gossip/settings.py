"""The mixing layer's objects a configuration names: the interpolation and the blend rule.

:mod:`dpwa.mixing` is pure math and knows nothing of configuration files; this is
where a :class:`~dpwa.config.Config`'s words become its objects.
"""

from __future__ import annotations

from ..config import Config
from ..mixing.interpolation import ClockWeighted, Constant, Interpolation, LossWeighted
from ..mixing.rules import Blend, DeltaBlend, StateBlend

__all__ = ["blend_of", "interpolation_of"]


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
