"""pushsum: push-sum averaging (Kempe, Dobra and Gehrke 2003; SGP, Assran et al. 2019) over one-sided pulls.

Each node i holds a weight w_i (1 at start) besides its parameters x_i, and
the pair (w_i x_i, w_i) is its mass. When node j serves a fetch, it gives
half its weight away with the snapshot (``carried weight = w_j / 2``; it keeps
``w_j / 2``, and its parameters do not move). The requester adds that mass to
its own:

    x_i = (w_i x_i + g x_j) / (w_i + g),   w_i = w_i + g,   g = w_j / 2

that is ``x_i += f (x_j - x_i)`` with ``f = g / (w_i + g)``. Every transfer
keeps the sums of w and of w x, so with nothing trained in between the
nodes' weighted mean ``sum w x / sum w`` never drifts, as it does under the
plain pull rules, and there is no confirm round trip: the mass moves with the
reply. A reply that is lost (its requester stopped waiting for it) loses its
mass: the weights then sum to less than n and the mean shifts by what that
mass held. Every node counts the weight it gave and the weight it took in
(``rule.given``, ``rule.taken``), so a cluster's loss is the sum of the first
less the sum of the second. A requester starts again from weight 1 when it
restarts.

**The weight goes with the parameters it belongs to.** A fetch is served
the snapshot of the server's last publish, which may be older than its
parameters: a blend since then moved both its parameters and its weight.
Half the weight of now, sent with the parameters of then, would not keep
``sum w x`` (four honest nodes lost 7% to 10% of their weighted mean in 6 s
that way). So the rule gives weight only with the snapshot that holds its
parameters as they are (:meth:`PushSum.published`); from a blend until the
next publish a fetch is served weight 0, and the requester blends nothing.

**A peer's weight is bounded by conservation.** Every node starts at weight
1 and every transfer keeps the sum, so an honest cluster of at most n nodes
holds at most n in all (and what the floor below minted): a peer holds at
most ``n - w_i`` of it, and gives at most half that. A reply that claims
more is taken at ``(n - w_i) / 2`` when it claims at most
:data:`MINT_ALLOWANCE` x n more (the excess, weight minted at the floor, is
dropped and counted as ``rule.dropped``), and refused ``bad_carry`` before
anything moves when it claims more than that. (Refusing the minted excess
too would lose the whole reply's weight: 1.5 of four nodes' 4, once, for a
claim 0.23 x FLOOR past the bound.) A node's own weight never exceeds n. n
is the config's number of nodes (:meth:`PushSum.cluster`; with open
membership ``members_max`` + 1, a much weaker bound). So one reply of a
hostile peer moves a node by at most ``(n - w_i) / (n + w_i)`` of the way to
its snapshot (0.6 for n = 4 at weight 1), not 0.999999 as a claimed weight
of 1e6 did; the rest of what such a peer can do is in docs/rules.md.

**A node that gives and never gets back keeps a floor.** A member that
fetches and never serves takes half a node's weight each time; 25 such
fetches per node left every weight at 1.9e-6, and a node that holds next to
nothing gives next to nothing, so the cluster stopped mixing. A node's weight
never falls below :data:`FLOOR` (2**-20, about 1e-6, of a start): one at the
floor still gives half of it and keeps the floor, minting what it gives
(counted as ``rule.minted``). Mixing goes on, since a blend moves by the
ratio of two weights, however small both are; the cost is to the mean: each
serve at the floor adds at most ``FLOOR / 2`` of mass at the server's
snapshot. An honest node falls that far after 20 serves without a blend
that brought weight, which does happen: four honest nodes fetching from each
other every 20 ms for 6 s minted 0 to 7e-6 in all.

Mode pull only (the server's half is giving weight, which a pull does). The
weight a peer claims is checked against [0, :data:`MAX_WEIGHT`] and the
bound above.
"""

from __future__ import annotations

import threading
from typing import Any

from .. import interpolation as interp
from .base import Rule, RuleError, Side

FLOOR = 2.0**-20  # a node's weight never falls below this: at the floor it gives half and keeps the floor
MAX_WEIGHT = 1e6
MINT_ALLOWANCE = 2.0**-6  # per node of the cluster: a claim this far past the bound is taken at the bound


class PushSum(Rule):
    name = "pushsum"
    summary = "push-sum: one-sided pulls that move half the server's weight with its snapshot, keeping the mean"
    uses_own_snapshot = False
    carries = {"weight": (0.0, MAX_WEIGHT)}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()  # the Rx thread gives weight away while the training thread takes some in
        self.weight = 1.0
        self._given = 0.0  # the weight the snapshot being blended came with
        self._current: int | None = None  # the published snapshot that holds our parameters as they are now
        self.total = MAX_WEIGHT  # the most weight the cluster can hold (its most nodes: cluster())
        self.stale_serves = 0  # fetches served weight 0: their snapshot was older than our last blend
        self.minted = 0.0  # weight added to keep the floor (FLOOR): mass the cluster did not hold
        self.given = 0.0  # weight served with snapshots, in all
        self.taken = 0.0  # weight blended in from peers' snapshots, in all (a cluster's given - taken was lost)
        self.dropped = 0.0  # weight carried past the bound and dropped (minted at the floor), in all

    @classmethod
    def check_mode(cls, mode: str, settings: dict[str, Any]) -> None:
        if mode != "pull":
            raise RuleError("rule 'pushsum' needs mode pull (the weight moves with a fetched snapshot)")

    def served(self, version: int) -> dict[str, float]:
        with self._lock:
            if version != self._current:  # older than our parameters: our weight is not its weight
                self.stale_serves += 1
                return {"weight": 0.0}
            given = self.weight / 2
            self.given += given
            if self.weight - given < FLOOR:
                self.minted += FLOOR - (self.weight - given)
            self.weight = max(FLOOR, self.weight - given)
        return {"weight": given}

    def published(self, version: int) -> None:
        with self._lock:
            self._current = version

    def cluster(self, most_nodes: int) -> None:
        if not most_nodes >= 1:
            raise RuleError(f"pushsum: a cluster of {most_nodes!r} nodes")
        with self._lock:
            self.total = min(MAX_WEIGHT, float(most_nodes))

    def checked_carried(self, values: Any) -> dict[str, float]:
        checked = super().checked_carried(values)
        weight = checked["weight"]
        with self._lock:
            most = max(0.0, self.total - self.weight) / 2
            allowance = self.total * MINT_ALLOWANCE
            if weight > (most + allowance) * (1 + 1e-9):
                raise ValueError(
                    f"carried weight = {weight!r} is more than a peer can hold: at most (the cluster's "
                    f"{self.total:g} - ours {self.weight:.6g}) / 2 = {most:.6g} (every node starts at 1, and a "
                    f"fetch moves half of a peer's weight; up to {allowance:.3g} more, weight minted at the floor, "
                    "is taken at that bound)"
                )
            if weight > most:  # the cluster holds more than n: weight minted at the floor; the excess is dropped
                self.dropped += weight - most
                checked["weight"] = most
        return checked

    def factor(self, own: Side, peer: Side, symmetric: bool = False) -> float:
        self._given = (peer.carried or {}).get("weight", 0.0)  # for blend (the training thread calls both)
        with self._lock:
            return self._given / (self.weight + self._given) if self._given > 0 else 0.0

    def blend(self, params, own, peer, f, wire):
        given, self._given = self._given, 0.0
        if given <= 0.0:
            return 0.0
        with self._lock:  # the weight as it is now: the Rx thread may have given some away since factor
            self._current = None  # our parameters move: no snapshot of ours holds them until the next publish
            f = given / (self.weight + given)
            self.taken += given
            self.weight = min(self.total, self.weight + given)
        params.lerp_from(peer, f, wire)
        return f

    def report(self) -> dict[str, float]:
        with self._lock:
            return {
                "weight": self.weight,
                "minted": self.minted,
                "given": self.given,
                "taken": self.taken,
                "dropped": self.dropped,
            }

    def mass(self) -> float:
        with self._lock:
            return self.weight

    def clock(self, clock, own_clock, peer_clock, f):
        return interp.blend_clock(f, clock, peer_clock)


RULE = PushSum
