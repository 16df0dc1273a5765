"""Which path each peer's snapshots take: a same-host slot, a bulk stream, or ZeroMQ frames. One place decides.

A snapshot travels one of three ways between this node and a peer:

* **slot**: the peer is on this machine and both have shared-memory slots (``same_host: auto``): the reader
  locks the writer's slot and reads it in place (:mod:`dpwa.wire.shm`);
* **stream**: a large model (``bulk: auto``, 4 MiB or more) between hosts: the snapshot waits at the sender's
  bulk port and the reader dials it (:mod:`dpwa.wire.bulk`); a peer nobody can dial (``reachable: false``,
  behind a relay) is read from by no stream, and a node nobody can dial offers none;
* **message**: the frames of a ZeroMQ reply or request, always possible.

:class:`PeerPaths` holds what was decided at start and what the node learnt since: a peer whose slots cannot
be opened is read over ZeroMQ from then on; a peer that refuses our slot or our stream gets the payload from
then on; a stream that failed pauses streams with that peer (from :data:`BULK_PAUSE_S`, doubling with each
failure in a row, up to :data:`BULK_PAUSE_MAX_S`: :class:`dpwa.backoff.Backoffs`). It is shared by the node's
threads (a lock guards it) and holds no socket.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Literal

from ...backoff import Backoffs

__all__ = ["BULK_PAUSE_MAX_S", "BULK_PAUSE_S", "KEEP_SLOT_AFTER", "Path", "PeerPaths"]

Path = Literal["slot", "stream", "message"]
BULK_PAUSE_S = 1.0  # after a failed stream, a peer is not asked for one for this long (doubling in a row) ...
BULK_PAUSE_MAX_S = 60.0  # ... up to this
KEEP_SLOT_AFTER = ("shm_stale", "shm_busy")  # a peer that could not read our slot this once is asked by slot again


class PeerPaths:
    """How this node's snapshots and each peer's travel (any thread).

    Args:
        slots: same-host peers whose slots we read, and who read ours.
        stream_hosts: peers we stream snapshots with, and the host each one's bulk port is reached at.
        offers_streams: may peers dial our bulk port (False for a node nobody can dial)?
    """

    def __init__(
        self, slots: Iterable[str] = (), stream_hosts: Mapping[str, str] | None = None, offers_streams: bool = True
    ) -> None:
        self._lock = threading.Lock()
        self._reads_slot = set(slots)  # peers whose slots we read (dropped once theirs cannot be opened)
        self._names_slot = set(self._reads_slot)  # peers we name our slot to (dropped once one refuses)
        self._hosts = dict(stream_hosts or {})
        self._offers_to = set(self._hosts) if offers_streams else set()  # dropped once one refuses our stream
        self._paused: Backoffs[str] = Backoffs(BULK_PAUSE_S, BULK_PAUSE_MAX_S)

    # ----------------------------------------------------------------- a peer's snapshot, to us

    def incoming(self, peer: str, now: float) -> Path:
        """How to ask `peer` for its snapshot now."""
        with self._lock:
            if peer in self._reads_slot:
                return "slot"
            if peer in self._hosts and self._paused.ready(peer, now):
                return "stream"
            return "message"

    def reads_slot(self, peer: str) -> bool:
        with self._lock:
            return peer in self._reads_slot

    def host(self, peer: str) -> str | None:
        """Where `peer`'s bulk port is reached, if we stream with it at all (paused or not)."""
        with self._lock:
            return self._hosts.get(peer)

    def slot_unreadable(self, peer: str) -> None:
        """`peer`'s slots cannot be opened here (another user, say): read it over ZeroMQ from now on."""
        with self._lock:
            self._reads_slot.discard(peer)

    def stream_failed(self, peer: str, now: float) -> tuple[float, int]:
        """A stream with `peer` failed: no stream with it for a while. Returns (that pause, failures in a row)."""
        with self._lock:
            backoff = self._paused.get(peer)
            pause = backoff.peek()
            backoff.fail(now)
            return pause, backoff.failures

    def stream_worked(self, peer: str) -> None:
        with self._lock:
            self._paused.reset(peer)

    # ----------------------------------------------------------------- our snapshot, to a peer (mode symmetric)

    def outgoing(self, peer: str, now: float) -> Path:
        """How to send our snapshot with an exchange request to `peer` now (the payload if that fails)."""
        with self._lock:
            if peer in self._names_slot:
                return "slot"
            if peer in self._offers_to and self._paused.ready(peer, now):
                return "stream"
            return "message"

    def names_slot(self, peer: str) -> bool:
        """Do we name our slot to `peer` (it reads our snapshot in place)?"""
        with self._lock:
            return peer in self._names_slot

    def offers_streams(self) -> bool:
        with self._lock:
            return bool(self._offers_to)

    def refused(self, path: Path, refusals: Mapping[str, str]) -> set[str]:
        """Peers that refused our snapshot by `path` (peer -> the reason): they get the payload from now on,
        but for a slot read that failed only this once (:data:`KEEP_SLOT_AFTER`). Returns those dropped now."""
        gone = {peer for peer, reason in refusals.items() if path != "slot" or reason not in KEEP_SLOT_AFTER}
        with self._lock:
            kept = self._names_slot if path == "slot" else self._offers_to
            dropped = gone & kept
            kept -= dropped
        return dropped
