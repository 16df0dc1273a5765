"""Who exchanges with whom: a random peer by flow-control score, or a hypercube schedule.

With ``pairing: hypercube`` and n = 2^k nodes, node i's partner in round t is
``i XOR 2^(t mod k)``: in k rounds every node has met one partner along each
dimension of the hypercube, and if every exchange averages the pair exactly
(f = 1/2, nothing trained in between) every node holds the exact mean of all
n starting values after those k = log2 n rounds, where random pairing only
gets there geometrically. Rounds are counted per node (its update_send
calls), so nodes that step in step meet their scheduled partner; nodes that
drift apart still mix, only less perfectly.

In mode symmetric one exchange moves both sides, so only the lower index of
each pair starts it; in mode pull both sides pull from each other.

In mode symmetric a node takes part in one exchange at a time
(:mod:`dpwa.mixing.admission`), so a node that asks a random peer while
that peer asks someone else is refused: ``pairing: random`` there means a
random *matching* each round, drawn by every node from a seed they share
(:func:`matching_partner`), one exchange per pair and, for an odd count,
one node resting. In mode pull ``random`` is a peer drawn by flow-control
score, as in 2017.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

__all__ = ["PAIRINGS", "hypercube_partner", "initiates", "is_power_of_two", "matching_partner", "resolve", "seed_of"]

PAIRINGS = ("auto", "random", "hypercube")


def resolve(kind: str, n: int) -> str:
    """What ``pairing: auto`` means for n nodes: hypercube for a power of two (2, 4, 8, ...), else random."""
    if kind != "auto":
        return kind
    return "hypercube" if n >= 2 and is_power_of_two(n) else "random"


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hypercube_partner(index: int, n: int, round_: int) -> int:
    """Node `index`'s partner in round `round_` of the hypercube schedule of n = 2^k nodes."""
    if not is_power_of_two(n) or n < 2:
        raise ValueError(f"a hypercube needs a power of two of at least 2 nodes, got {n}")
    if not 0 <= index < n:
        raise ValueError(f"index must be in [0, {n}), got {index}")
    dimensions = n.bit_length() - 1
    return index ^ (1 << (round_ % dimensions))


def initiates(index: int, partner: int, mode: str) -> bool:
    """Does node `index` start this round's exchange with `partner`? (Symmetric: only the lower index.)"""
    return mode != "symmetric" or index < partner


def seed_of(names: Sequence[str]) -> int:
    """The seed every node of a cluster draws its random matchings from: its node names, in config order."""
    return zlib.crc32("\n".join(names).encode())


def matching_partner(index: int, n: int, round_: int, seed: int) -> tuple[int, bool] | None:
    """Node `index`'s partner in round `round_` of a random matching of n nodes, and whether `index` is the
    one that starts a symmetric exchange; None: it rests this round.

    Every node draws the same permutation from (`seed`, `round_`) and pairs its neighbours: positions 0 and
    1, 2 and 3, ... (the even position starts); with an odd n the last position rests. So each node is in
    at most one pair per round, and starts about half of its exchanges.
    """
    if not 0 <= index < n:
        raise ValueError(f"index must be in [0, {n}), got {index}")
    order = list(range(n))
    random.Random(seed * 1_000_003 + round_).shuffle(order)
    at = order.index(index)
    mate = at ^ 1
    return (order[mate], at % 2 == 0) if mate < n else None
