"""The requesting side of a node: fetch a peer's snapshot and take hold of it, checked.

Everything here runs as tasks of :class:`dpwa.wire.client.ClientThread`
(the node's Tx thread), or, for a small model in mode pull, of
:class:`dpwa.wire.client.DirectClient` on the training thread. A :class:`FetchTask` asks one peer
for its snapshot; :class:`ReplyReader` checks the reply (schema, fingerprint,
dtype, size, values) and holds on to its parameters as a :class:`Received`:
a received frame, a pooled buffer its chunks were copied into, or, from a
same-host peer, its shared-memory slot locked for reading. Whoever holds a
``Received`` owns that memory until it lets go (a ``with`` block): the frame
is dropped, the buffer goes back to its pool, the slot's lock is released.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..stats import Counters
from ..wire.bulk import BulkReceiver
from ..wire.client import Ask, Response
from ..wire.messages import Header, MessageKind, ProtocolError, encode
from ..wire.payload import BufferPool
from ..wire.shm import PeerSlots
from .messages import BULK_PARAMS, FETCH, SHM_PARAMS, SNAPSHOT_REPLIES, check_payload
from .validation import PeerValues

__all__ = ["FetchTask", "Received", "ReplyReader", "SAME_HOST_ATTEMPTS", "holding"]

SAME_HOST_ATTEMPTS = 4  # asks when a same-host slot was rewritten before we locked it
_RETRY = ("shm_stale", "shm_busy")


class Received:
    """A peer's snapshot held for blending: its header, its elements, and how to let go of them."""

    __slots__ = ("header", "array", "_release")

    def __init__(self, header: Header, array: np.ndarray, release: Callable[[], None]) -> None:
        self.header, self.array = header, array
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        """Give the memory back (a frame to the client thread, a shared slot's lock). Idempotent."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> Received:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ReplyReader:
    """Checks snapshot replies and takes hold of their parameters (on one thread: the client thread,
    or the training thread when a small model's fetches run there).

    Args:
        fingerprint, wire, nbytes: what our model looks like on the wire.
        values: the checks every peer's parameters must pass.
        readers: same-host peers whose shared-memory slots we may read (a peer
            is dropped from it, and asked over TCP, once its slots cannot be opened).
        counters: where to count bytes and same-host reads.
        bulk_hosts: peers we ask for bulk transfers (dpwa.wire.bulk), and the host each is reached at.
    """

    def __init__(
        self,
        fingerprint: bytes,
        wire: str,
        nbytes: int,
        storage: np.dtype,
        values: PeerValues,
        readers: dict[str, PeerSlots],
        counters: Counters,
        log: Callable[[str], None],
        bulk_hosts: dict[str, str] | None = None,
    ) -> None:
        self.fingerprint, self.wire, self.nbytes, self.storage = fingerprint, wire, nbytes, storage
        self.values = values
        self.readers = readers
        self.bulk_hosts = dict(bulk_hosts or {})
        self._bulk = BulkReceiver()
        # a snapshot that came in chunks is copied into one of these (two kept: one blending, one arriving)
        self._buffers = BufferPool(nbytes)
        self._counters = counters
        self._log = log

    def wants_shm(self, peer: str) -> bool:
        return peer in self.readers

    def wants_bulk(self, peer: str) -> bool:
        return peer in self.bulk_hosts

    def read(self, response: Response, peer: str, deadline: float = math.inf) -> Received:
        """The parameters of a snapshot reply, checked; ProtocolError if unusable (TransportError if a
        bulk transfer fails). A bulk transfer must be in by `deadline`."""
        header = response.header
        check_payload(header, fp=self.fingerprint, dtype=self.wire, nbytes=self.nbytes)
        if header.kind == SHM_PARAMS.name:
            received = self._read_slot(header, peer)
        elif header.kind == BULK_PARAMS.name:
            return self._read_bulk(header, peer, deadline)
        else:
            payload = response.frames[0]
            if len(payload) != self.nbytes:
                raise ProtocolError("bad_size", f"the payload holds {len(payload)} bytes, the header {self.nbytes}")
            array, release = payload.array(self.storage, self._buffers)
            self._counters.add("bytes_in", self.nbytes)
            received = Received(header, array, release)
        with contextlib.ExitStack() as keep:
            keep.push(received)  # released if the check fails
            self.values.check(received.array)
            keep.pop_all()
        return received

    def _read_bulk(self, header: Header, peer: str, deadline: float) -> Received:
        """Stream the snapshot straight into a pooled buffer, checking each block as it arrives."""
        host = self.bulk_hosts.get(peer)
        if host is None:
            raise ProtocolError("bad_reply", "a bulk transfer that was not asked for")
        buffer, give_back = self._buffers.take()
        with contextlib.ExitStack() as keep:
            keep.callback(give_back)  # given back if anything fails
            array = buffer.view(self.storage)
            size = array.itemsize

            def check(start: int, end: int) -> None:
                self.values.check_values(array[start // size : end // size])

            self._bulk.receive(host, header["port"], header["token"], buffer, deadline, check)
            self.values.check_distance(array)
            keep.pop_all()
        self._counters.add("bytes_in", self.nbytes)
        self._counters.add("bulk_fetches")
        return Received(header, array, give_back)

    def _read_slot(self, header: Header, peer: str) -> Received:
        reader = self.readers.get(peer)
        if reader is None:
            raise ProtocolError("bad_reply", "a shared-memory reply that was not asked for")
        try:
            view = reader.acquire(header["shm_id"], header["shm_slot"], header["version"], self.nbytes, self.storage)
        except ProtocolError as exc:
            if exc.reason == "shm_unavailable":  # e.g. the peer runs as another user: use TCP from now on
                self.readers.pop(peer, None)
                reader.close()
                self._log(f"{exc.detail}: falling back to TCP for {peer}")
            raise
        self._counters.add("same_host_fetches")
        self._counters.add("shm_bytes_in", self.nbytes)
        return Received(header, view.array, view.release)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        self._bulk.close()


class FetchTask:
    """Fetch one peer's snapshot (pull mode). Its value is a :class:`Received`."""

    def __init__(self, peer: str, deadline: float, name: str, reader: ReplyReader) -> None:
        self.peer, self.deadline = peer, deadline
        self._reader = reader
        self._fields: dict[str, Any] = {"from": name, "fp": reader.fingerprint, "dtype": reader.wire}
        if reader.wants_shm(peer):
            self._fields["shm"] = True
        elif reader.wants_bulk(peer):
            self._fields["bulk"] = True
        self.retries = 0

    def first_request(self, request_id: int) -> tuple[list[bytes], dict[str, MessageKind]]:
        """The request run() makes first (so a DirectClient can send it early)."""
        return [encode(FETCH, request_id, **self._fields)], SNAPSHOT_REPLIES

    def run(self, ask: Ask) -> Received:
        for attempts_left in range(SAME_HOST_ATTEMPTS - 1, -1, -1):
            response = ask(lambda rid: self.first_request(rid)[0], SNAPSHOT_REPLIES)
            try:
                return self._reader.read(response, self.peer, self.deadline)
            except ProtocolError as exc:
                if exc.reason not in _RETRY or not attempts_left:
                    raise
                self.retries += 1  # the slot was rewritten between the reply and our lock: ask again
        raise AssertionError("unreachable")


@contextlib.contextmanager
def holding(value: Any) -> Iterator[Any]:
    """Release `value` if the block raises; keep it otherwise (ownership passes on)."""
    try:
        yield value
    except BaseException:
        if value is not None:
            value.release()
        raise
