"""How an exchange changes the models: pure math, shared by the node and the simulator.

Notation for one exchange between a requester i and a server j:
``x`` are current parameters, ``s`` the snapshots published at ``update_send``
and exchanged, ``f`` the factor chosen by interpolation.

=====================  =======================================  ==========================================
rule                   requester i                              server j
=====================  =======================================  ==========================================
pull, blend state      x_i += f (s_j - x_i)   (the original)    unchanged
pull, blend delta      x_i += f (s_j - s_i)                      unchanged
symmetric, delta       x_i += f (s_j - s_i)                      x_j += f (s_i - s_j), once i confirms
symmetric, state       x_i += f (s_j - x_i)                      x_j += f (s_i - s_j), once i confirms
=====================  =======================================  ==========================================

*state* pulls the requester's whole current state, so the gradient step it
took since its snapshot is scaled by ``1 - f``. *delta* moves it by the
difference of the two exchanged snapshots, so that step is kept whole.
With *symmetric* the two corrections of a delta exchange are exact opposites,
so the mean of all nodes' parameters is preserved (up to float rounding);
with state it is preserved only when nothing changed between publishing and
blending (pure averaging).

Every correction is taken relative to a snapshot, so a node that takes part
in k exchanges on one state ends at ``(1 - k f) s_i + f * sum(partners)``:
at k = 2 and f = 1/2 its own weight is zero and two nodes swap instead of
averaging. So in symmetric mode a node takes part in one unsettled exchange
at a time and each snapshot in one exchange (:mod:`dpwa.mixing.admission`):
its own weight is then ``1 - f >= 1/2`` after any exchange. Further requests
are answered ``busy``.

Clocks follow the same rules as the parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from . import interpolation as interp
from .params import FlatParams

__all__ = [
    "Blend",
    "DeltaBlend",
    "MAX_SYMMETRIC_FACTOR",
    "StateBlend",
    "mirror",
    "mirror_clock",
    "symmetric_factor",
]

MAX_SYMMETRIC_FACTOR = 0.5  # beyond it a symmetric exchange would move a side past its partner


class Blend(ABC):
    """The requester's rule for applying a fetched snapshot."""

    name: str

    @abstractmethod
    def apply(self, params: FlatParams, own: np.ndarray | None, peer: np.ndarray, f: float, wire: str) -> None:
        """Change `params` in place given our snapshot `own` (None: not kept) and the peer's snapshot `peer`."""

    @abstractmethod
    def clock(self, clock: float, own_clock: float, peer_clock: float, f: float) -> float:
        """Our clock after the blend (`own_clock` is the clock our snapshot carried)."""


class StateBlend(Blend):
    """x += f (peer - x): the original rule."""

    name = "state"

    def apply(self, params, own, peer, f, wire):
        params.lerp_from(peer, f, wire)

    def clock(self, clock, own_clock, peer_clock, f):
        return interp.blend_clock(f, clock, peer_clock)


class DeltaBlend(Blend):
    """x += f (peer - own): move by the difference of the exchanged snapshots."""

    name = "delta"

    def apply(self, params, own, peer, f, wire):
        if own is None:
            raise ValueError("blend delta needs our own snapshot")
        params.add_scaled_diff_from(peer, own, f, wire)

    def clock(self, clock, own_clock, peer_clock, f):
        return clock + f * (peer_clock - own_clock)


def mirror(params: FlatParams, served: np.ndarray, requester: np.ndarray, f: float, wire: str) -> None:
    """The server's half of a symmetric exchange: x_j += f (s_i - s_j)."""
    params.add_scaled_diff_from(requester, served, f, wire)


def mirror_clock(clock: float, served_clock: float, requester_clock: float, f: float) -> float:
    return clock + f * (requester_clock - served_clock)


def symmetric_factor(
    interpolation: interp.Interpolation,
    divergence_threshold: float,
    requester: tuple[float, float | None],
    server: tuple[float, float | None],
) -> float:
    """f of a symmetric exchange, from the two exchanged snapshots' (clock, loss).

    Both sides compute it from the same four numbers, from the requester's
    point of view, so they agree exactly; the divergence threshold applies to
    the requester's loss. Capped at 1/2: neither side ever moves past the midpoint.
    """
    f = interpolation.factor(requester[0], server[0], requester[1], server[1])
    f = interp.damp_by_divergence(f, requester[1], divergence_threshold)
    return min(max(f, 0.0), MAX_SYMMETRIC_FACTOR)
