"""The checks a peer's parameters must pass before anyone blends them.

Headers are range-checked by their schemas (:mod:`dpwa.gossip.transfer.protocol`);
this module checks what only the payload can tell: that every value is
finite and within :data:`~dpwa.gossip.transfer.protocol.MAX_VALUE` (so a blend cannot
overflow), and, with ``max_peer_distance``, that the peer is not implausibly
far from our own snapshot. Both the requester (a reply) and the server (an
exchange request) use it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...mixing import kernels
from ...wire.errors import ProtocolError
from .protocol import MAX_VALUE
from .snapshots import Lease

__all__ = ["PeerValues"]


class PeerValues:
    """Checks a peer's flat parameters; raises ProtocolError (``not_finite``, ``too_far``) to refuse them.

    Args:
        wire: the wire dtype of the buffers.
        max_peer_distance: when > 0, refuse ``||peer - ours|| / ||ours||`` above it.
        reference: leases our current snapshot (the distance is measured from it).
    """

    def __init__(self, wire: str, max_peer_distance: float, reference: Callable[[], Lease | None]) -> None:
        self.wire = wire
        self.max_peer_distance = max_peer_distance
        self._reference = reference
        kernels.prepare(wire)  # here, not on the thread that meets the first peer's buffer

    def check(self, array: np.ndarray) -> None:
        self.check_values(array)
        self.check_distance(array)

    def check_values(self, part: np.ndarray) -> None:
        """Every value of `part` (all of a peer's parameters, or a block of them) finite and within bounds."""
        if not kernels.within(part, MAX_VALUE, self.wire):
            raise ProtocolError("not_finite", f"the parameters hold NaN, Inf or values beyond ±{MAX_VALUE:g}")

    def check_distance(self, array: np.ndarray) -> None:
        """With max_peer_distance: all of a peer's parameters not implausibly far from our snapshot."""
        if self.max_peer_distance <= 0:
            return
        lease = self._reference()
        if lease is None:
            return
        with lease:
            distance = kernels.relative_distance(array, lease.snapshot.array, self.wire)
        if distance > self.max_peer_distance:
            raise ProtocolError(
                "too_far",
                f"||peer - ours|| / ||ours|| = {distance:.3g} exceeds max_peer_distance {self.max_peer_distance:g}",
            )
