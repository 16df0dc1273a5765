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


def pairing_of(config: Config, name: str) -> Callable[[int], tuple[str | None, bool]] | None:
    """The schedule, round -> (our partner or None to rest, whether we start the exchange), when the config's
    pairing has one: ``hypercube`` (or ``auto`` with a power of two of nodes), and in mode symmetric also
    ``random`` (a random matching each round, from a seed every node shares). None: a random peer by score."""
    order = [spec.name for spec in config.nodes]
    kind = pairing.resolve(config.pairing, len(order))
    index, n, mode = order.index(name), len(order), config.mode
    if kind == "hypercube":

        def partner(round_: int) -> tuple[str | None, bool]:
            other = pairing.hypercube_partner(index, n, round_)
            return order[other], pairing.initiates(index, other, mode)

        return partner
    if mode != "symmetric":
        return None
    seed = pairing.seed_of(order)

    def matched(round_: int) -> tuple[str | None, bool]:
        pair = pairing.matching_partner(index, n, round_, seed)
        return (None, False) if pair is None else (order[pair[0]], pair[1])

    return matched
