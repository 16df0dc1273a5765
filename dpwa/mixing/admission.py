"""Which symmetric exchanges a node may take part in, so that no pattern of exchanges erases its own state.

Every correction of an exchange is taken relative to a published snapshot:
the requester moves by ``f (s_j - s_i)``, the server by ``f (s_i - s_j)``
(:mod:`dpwa.mixing.rules`). A node that takes part in k exchanges whose
corrections are all relative to one state ends at

    (1 - k f) s_i + f * (s_1 + ... + s_k)

so its own weight is ``1 - k f``. At two nodes that both start an exchange
with each other in one step, k = 2 and f = 1/2 give weight zero: the models
swap instead of averaging. Counting only exchanges per snapshot is not
enough either: an exchange that is pending on snapshot t and applied after
the node published t + 1 stacks with one on t + 1 the same way.

The rule, :class:`Admission`: **a node takes part in at most one unsettled
exchange at a time, as requester or as server, and a snapshot takes part in
at most one exchange.** An exchange is unsettled from the moment it is
started or served until its half is applied, or until it is known that
neither side applies anything. A snapshot that took part in an exchange
whose half was applied is stale (the node has moved since), and so is
every snapshot published before that half was applied: none of them serves
another exchange, and the node publishes a fresh one. So every applied correction is
relative to a snapshot that already holds every earlier correction, the
node's weight on its own state after any exchange is ``1 - f``, and with
``f <= 1/2`` (:data:`dpwa.mixing.rules.MAX_SYMMETRIC_FACTOR`) never below
:data:`OWN_WEIGHT_FLOOR`.

Pure bookkeeping, not thread-safe: its owner (the node's exchange server)
calls it under its own lock.
"""

from __future__ import annotations

__all__ = ["OWN_WEIGHT_FLOOR", "Admission"]

OWN_WEIGHT_FLOOR = 0.5  # a node's weight on its own state after any exchange: 1 - f, with f <= 1/2


class Admission:
    """One node's exchanges in mode symmetric: one unsettled at a time, one per snapshot."""

    def __init__(self) -> None:
        self.unsettled: str | None = None  # "own" or "served" while an exchange is unsettled
        self._version = 0  # the snapshot version of the unsettled exchange (versions only grow)
        self.stale = 0  # snapshots up to this version took part in an applied exchange

    def refusal(self, version: int) -> str:
        """Why snapshot `version` may not take part in an exchange now ("" when it may)."""
        if self.unsettled is not None:
            return f"this node is in another exchange ({self.unsettled}, not yet applied)"
        if version <= self.stale:
            return "this snapshot already took part in an exchange; a fresh one comes at the node's next step"
        return ""

    def take(self, version: int, role: str) -> bool:
        """Enter an exchange on snapshot `version` as `role` ("own" or "served"), if the rule allows it."""
        if self.refusal(version):
            return False
        self.unsettled, self._version = role, version
        return True

    def hand_over(self, version: int, role: str) -> bool:
        """The unsettled exchange, which has applied nothing and never will (our own, given way before its
        confirm), is replaced by one in `role` on snapshot `version`, if that snapshot is fresh."""
        if self.unsettled is None or version <= self.stale:
            return False
        self.unsettled, self._version = role, version
        return True

    def give_back(self) -> None:
        """The unsettled exchange ended with nothing applied on either side: its snapshot may serve again."""
        self.unsettled = None

    def settle(self, published: int) -> None:
        """The unsettled exchange's half is applied: the node moved, so every snapshot published so far (up
        to version `published`, the latest) is stale, not only the one the exchange used."""
        self.stale = max(self.stale, self._version, published)
        self.unsettled = None

    def spent(self, version: int) -> bool:
        """Has snapshot `version` taken part in an applied exchange, with nothing unsettled (publish a fresh one)?"""
        return self.unsettled is None and version <= self.stale
