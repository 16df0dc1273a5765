"""Deadlines that follow the link: each peer's request time, estimated as TCP estimates its round trip.

Pure bookkeeping: no socket, thread or clock (the caller passes the times),
so the rule is tested with plain numbers. Its owner is the node's training
thread.

One estimate per peer and *kind* of request (a snapshot fetch, a symmetric
exchange with its confirm: each moves the model's bytes; the caller names
the kind), kept as RFC 6298 keeps a TCP connection's:

* the first sample R sets ``srtt = R`` and ``rttvar = R / 2``;
* each later one: ``rttvar = 3/4 rttvar + 1/4 |srtt - R|``, then
  ``srtt = 7/8 srtt + 1/8 R``;
* the deadline is ``srtt + 4 rttvar``, never below ``floor_s`` (the
  configured ``timeout_ms``) nor above ``cap_s`` (:data:`CAP_FACTOR` times
  it). **timeout_ms is the floor**: a request is never given less than the
  configuration says, and a slow link gets more, up to the cap;
* a request that timed out doubles that peer's deadline (the back-off), up to
  the cap; its next sample resets the back-off. Only requests that were
  answered are sampled (a timed-out one says only that the link took longer:
  Karn's rule), so the doubling is how the estimate learns of replies that
  came too late to be seen.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CAP_FACTOR", "Deadlines", "Estimate", "cap_s"]

CAP_FACTOR = 4.0  # a deadline is at most this many times timeout_ms (update_wait waits at most this long)
ALPHA = 1 / 8  # srtt's gain (RFC 6298)
BETA = 1 / 4  # rttvar's gain
K = 4.0  # deadline = srtt + K rttvar
MAX_KEYS = 4096  # (peer, kind) estimates kept at most (open membership: members come and go)


def cap_s(timeout_s: float, dead_after_s: float | None = None) -> float:
    """The longest deadline: CAP_FACTOR x `timeout_s`; with open membership (`dead_after_s`, the time a suspect
    member has before it is removed) no longer than that, as `timeout_s` itself is checked against it: a node
    that waits out a long deadline sends no digest meanwhile, so its heartbeat stops rising. Never below
    `timeout_s`."""
    cap = CAP_FACTOR * timeout_s
    if dead_after_s is not None:
        cap = min(cap, dead_after_s)
    return max(timeout_s, cap)


@dataclass
class Estimate:
    """One peer's request time for one kind of request, in seconds."""

    srtt: float
    rttvar: float
    backoff: float = 1.0  # doubled by each timeout since the last sample


class Deadlines:
    """Per peer and kind, how long the next request may take.

    Args:
        floor_s: the least any request is given (``timeout_ms``), and the deadline of a peer never sampled.
        cap_s: the most any request is given (default :data:`CAP_FACTOR` times the floor).
    """

    def __init__(self, floor_s: float, cap_s: float | None = None) -> None:
        if not floor_s > 0:
            raise ValueError(f"floor_s must be positive, got {floor_s!r}")
        cap = CAP_FACTOR * floor_s if cap_s is None else cap_s
        if cap < floor_s:
            raise ValueError(f"cap_s ({cap!r}) must be at least floor_s ({floor_s!r})")
        self.floor_s, self.cap_s = floor_s, cap
        self._estimates: dict[tuple[str, str], Estimate] = {}

    def deadline_s(self, peer: str, kind: str) -> float:
        """The time the next `kind` request to `peer` is given: its estimate's, within [floor_s, cap_s]."""
        est = self._estimates.get((peer, kind))
        if est is None:
            return self.floor_s
        return min(self.cap_s, max(self.floor_s, (est.srtt + K * est.rttvar) * est.backoff))

    def sample(self, peer: str, kind: str, took_s: float) -> None:
        """A `kind` request to `peer` was answered after `took_s` seconds."""
        if not took_s >= 0:  # NaN or negative: a clock's glitch, not a sample
            return
        key = (peer, kind)
        est = self._estimates.get(key)
        if est is None:
            if len(self._estimates) >= MAX_KEYS:
                return
            self._estimates[key] = Estimate(took_s, took_s / 2)
            return
        est.rttvar = (1 - BETA) * est.rttvar + BETA * abs(est.srtt - took_s)
        est.srtt = (1 - ALPHA) * est.srtt + ALPHA * took_s
        est.backoff = 1.0

    def timed_out(self, peer: str, kind: str) -> None:
        """A `kind` request to `peer` got no answer in its deadline: the next one is given twice as long."""
        key = (peer, kind)
        est = self._estimates.get(key)
        if est is None:
            if len(self._estimates) >= MAX_KEYS:
                return
            # never answered: an estimate whose deadline is the floor (srtt + K rttvar = floor), so the doubling
            # starts there
            est = self._estimates[key] = Estimate(self.floor_s / 3, self.floor_s / 6)
        if self.deadline_s(peer, kind) < self.cap_s:
            est.backoff *= 2

    def forget(self, peer: str) -> None:
        """`peer` left (open membership): its estimates go."""
        for key in [k for k in self._estimates if k[0] == peer]:
            del self._estimates[key]

    def estimate(self, peer: str, kind: str) -> Estimate | None:
        """The estimate, for reports and tests (a copy)."""
        est = self._estimates.get((peer, kind))
        return None if est is None else Estimate(est.srtt, est.rttvar, est.backoff)
