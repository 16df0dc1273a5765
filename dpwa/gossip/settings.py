"""The mixing layer's objects a configuration names: the interpolation, the rule, the pairing.

:mod:`dpwa.mixing` is pure math and knows nothing of configuration files; this is
where a :class:`~dpwa.config.Config`'s words become its objects.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import Config
from ..mixing import pairing
from ..mixing.interpolation import ClockWeighted, Constant, Interpolation, LossWeighted
from ..mixing.rules import Rule, rule_class

__all__ = ["interpolation_of", "pairing_of", "rule_of", "start_share_of"]


def interpolation_of(config: Config) -> Interpolation:
    """The interpolation named by ``config.interpolation``."""
    if config.interpolation == "constant":
        return Constant(config.constant.value)
    if config.interpolation == "clock":
        return ClockWeighted()
    if config.interpolation == "loss":
        return LossWeighted()
    raise ValueError(f"unknown interpolation {config.interpolation!r}")


def rule_of(config: Config) -> Rule:
    """The mixing rule named by ``config.rule``, with its options, the interpolation and the threshold."""
    rule = rule_class(config.rule)
    return rule(interpolation_of(config), config.divergence_threshold, **dict(config.rule_options))


def pairing_of(config: Config, name: str) -> Callable[[int], tuple[str, bool]] | None:
    """The hypercube schedule, round -> (our partner, whether we start the exchange), when the config's
    pairing is one (``hypercube``, or ``auto`` with a power of two of nodes); None: a random peer by score."""
    order = [spec.name for spec in config.nodes]
    if pairing.resolve(config.pairing, len(order)) != "hypercube":
        return None
    index, n, mode = order.index(name), len(order), config.mode

    def partner(round_: int) -> tuple[str, bool]:
        other = pairing.hypercube_partner(index, n, round_)
        return order[other], pairing.initiates(index, other, mode)

    return partner


def start_share_of(config: Config) -> float:
    """The share of steps in which a node starts an exchange, besides fetch_probability (dpwa.mixing.pairing)."""
    return pairing.start_share(pairing.resolve(config.pairing, len(config.nodes)), config.mode)
