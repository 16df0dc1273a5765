"""Symmetric exchanges: both halves applied, or neither.

One exchange between a requester i and a server j runs in two round trips,
both on i's Tx thread and within i's fetch deadline:

1. ``exchange``: i sends its snapshot s_i; j validates it, records a
   :class:`Pending` exchange (holding s_i and a lease on the s_j it serves)
   and replies with s_j.
2. ``confirm``: i validates s_j, computes f from the two snapshots' clocks and
   losses, and sends ``confirm(xid, f)``; j marks the exchange confirmed and
   answers ``ack``. Only then does i queue its half for its next
   ``update_wait``; j applies the mirror image at its own next update.

A reply that is lost or late, or a confirm that never arrives, leaves the
exchange unconfirmed: j drops it after ``ttl_s`` and i applies nothing. A
confirm is idempotent, so i may repeat it when an ``ack`` is lost. The one
remaining gap: j records the confirm but every ``ack`` and retry is lost until
i's deadline (j unreachable at exactly that moment); then j applies and i
does not, and that exchange's correction is missing from the mean.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .snapshot import Lease

__all__ = ["Pending", "PendingExchanges"]


@dataclass(eq=False)
class Pending:
    """The server's record of one exchange."""

    xid: int  # the exchange request's id
    peer: str  # the requester's name
    requester: np.ndarray  # s_i, as received
    requester_clock: float
    served: Lease  # s_j, the snapshot we sent back
    expires: float  # time.monotonic() after which an unconfirmed exchange is dropped
    release_requester: Callable[[], None]  # gives s_i's memory back
    f: float | None = None  # set by the confirm
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.requester = None
            self.served.release()
            self.release_requester()


class PendingExchanges:
    """Exchanges served and not yet applied. The Rx thread adds and confirms; the training thread applies."""

    def __init__(self, ttl_s: float, capacity: int) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        # exchanges already handed over for applying, remembered for one ttl so that a
        # repeated confirm (its first ack was lost) is still acknowledged
        self._taken: dict[int, tuple[str, float, float]] = {}  # xid -> (peer, f, forget after)
        self.expired = 0  # exchanges dropped without a confirm

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def add(self, pending: Pending) -> bool:
        """Record an exchange; False (and nothing recorded) when `capacity` are pending."""
        with self._lock:
            self._expire(time.monotonic())
            if len(self._pending) >= self.capacity:
                return False
            self._pending[pending.xid] = pending
            return True

    def confirm(self, xid: int, peer: str, f: float) -> bool:
        """Mark exchange `xid` of `peer` confirmed with factor f. Idempotent.

        False if it is unknown, expired or someone else's: then it will not be applied.
        """
        with self._lock:
            pending = self._pending.get(xid)
            if pending is None:
                taken = self._taken.get(xid)
                return taken is not None and taken[:2] == (peer, f)
            if pending.peer != peer:
                return False
            if pending.f is None:
                if time.monotonic() >= pending.expires:
                    return False
                pending.f = f
            return pending.f == f

    def take_confirmed(self) -> list[Pending]:
        """Remove and return the confirmed exchanges (the caller applies, then releases them)."""
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            done = [p for p in self._pending.values() if p.f is not None]
            for p in done:
                del self._pending[p.xid]
                self._taken[p.xid] = (p.peer, p.f, now + self.ttl_s)
            return done

    def _expire(self, now: float) -> None:
        for xid in [x for x, p in self._pending.items() if p.f is None and now >= p.expires]:
            self._pending.pop(xid).release()
            self.expired += 1
        for xid in [x for x, (_, _, forget) in self._taken.items() if now >= forget]:
            del self._taken[xid]

    def close(self) -> None:
        with self._lock:
            for pending in self._pending.values():
                pending.release()
            self._pending.clear()
