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
(:mod:`dpwa.mixing.admission`), so a node that starts an exchange cannot
serve one meanwhile: if every node started one each step, every request
would find its peer busy. With ``pairing: random`` there, each step a node
starts an exchange only with probability :data:`SYMMETRIC_START_SHARE` (a
coin of its own) and otherwise serves; the ones it starts go to peers by
flow-control score, the next candidate when one is busy. No round has to
agree between nodes, so nodes that drift apart lose nothing. In mode pull
``random`` is a peer drawn by score at every step, as in 2017.
"""

from __future__ import annotations

__all__ = [
    "PAIRINGS",
    "SYMMETRIC_START_SHARE",
    "hypercube_partner",
    "initiates",
    "is_power_of_two",
    "resolve",
    "start_share",
]

PAIRINGS = ("auto", "random", "hypercube")
SYMMETRIC_START_SHARE = 0.5  # mode symmetric, pairing random: the share of steps in which a node starts an exchange


def start_share(kind: str, mode: str) -> float:
    """The share of its steps in which a node starts an exchange (times fetch_probability), for a resolved
    pairing `kind`: :data:`SYMMETRIC_START_SHARE` for random pairing in mode symmetric, else 1 (a schedule
    says who starts; in mode pull everyone does)."""
    return SYMMETRIC_START_SHARE if kind == "random" and mode == "symmetric" else 1.0


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
