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

A large snapshot may come by stream (:mod:`dpwa.wire.bulk`; sealed with a key
of its own where the cluster has CURVE keys). When the stream fails (no
connection, cut, stalled, a block that fails authentication), the fetch asks
the same peer again over ZeroMQ within the same deadline (counted
``bulk_fallbacks``, logged rate-limited), and the reader stops asking that
peer for streams for a while: from :data:`BULK_PAUSE_S`, doubling with each
failure in a row, up to :data:`BULK_PAUSE_MAX_S`. So a peer or an attacker
that spoils streams costs a delay, never a fetch.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ...logs import RateLimitedLog
from ...mixing.codecs import CodecError, Fields
from ...mixing.model import WireModel
from ...stats import Counters
from ...wire.bulk import BulkError, BulkReceiver
from ...wire.calls import Ask, Response
from ...wire.errors import ProtocolError
from ...wire.payload import BufferPool, Payload
from ...wire.schema import Header, MessageKind, encode
from ...wire.shm import PeerSlots
from ..membership.members import Members
from .paths import BULK_PAUSE_MAX_S, BULK_PAUSE_S, PeerPaths
from .protocol import BULK_PARAMS, FETCH, MAX_VALUE, SHM_PARAMS, SNAPSHOT_REPLIES, check_payload
from .validation import PeerValues

__all__ = ["BULK_PAUSE_MAX_S", "BULK_PAUSE_S", "FetchTask", "Received", "ReplyReader", "SAME_HOST_ATTEMPTS", "holding"]

SAME_HOST_ATTEMPTS = 4  # asks when a same-host slot was rewritten before we locked it
BULK_FIRST_BYTE_SHARE = 0.5  # a stream's first byte, and its last, must come within this share of the time left,
# so the fetch can still go over ZeroMQ when a flood, a dead port or a stream that stalls holds it up
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


class Arrivals:
    """A snapshot's payload as it arrived, as an array in the dtype snapshots are kept in: read in place, copied
    out of its chunks into a pooled buffer, or (a compressing codec: int8, topk) decoded into one by the
    codec's receiver, which checks every value first.

    Owned by one thread; the buffers it hands out go back to their pools when released.

    Args:
        model: what our model looks like on the wire.
        peers: how many peers we may receive from (a codec's memory budget: topk keeps a copy per peer).
        spare: memory of the node's own to receive a snapshot into (``SnapshotStore.borrow``: a slot nobody
            holds), before a buffer of this one's; None: buffers of its own.
    """

    def __init__(
        self,
        model: WireModel,
        peers: int = 1,
        spare: Callable[[], tuple[np.ndarray, Callable[[], None]] | None] | None = None,
    ) -> None:
        self.model = model
        self.receiver = model.codec.receiver(peers)
        # a snapshot that came in chunks (or by stream) is copied into one of these: a slot the store lends,
        # else one of ours (two kept: one blending, one arriving; none where the store lends); an encoded one
        # arrives in a buffer of ours and is decoded into the lent slot
        self.wire = BufferPool(model.nbytes, spare=spare if self.receiver is None else None)
        self._kept = BufferPool(model.kept_nbytes, spare=spare) if self.receiver is not None else None

    def request(self, peer: str) -> dict[str, Any]:
        """Fields for a fetch from `peer`: what the codec already holds from it."""
        return self.receiver.request(peer) if self.receiver is not None else {}

    def take(self, payload: Payload, header: Fields, peer: str) -> tuple[np.ndarray, Callable[[], None]]:
        if self._kept is None:
            return payload.array(self.model.storage, self.wire)
        raw, release_raw = payload.array(np.uint8, self.wire)
        try:
            return self.decode(raw, header, peer)
        finally:
            release_raw()

    def decode(self, raw: np.ndarray, header: Fields, peer: str) -> tuple[np.ndarray, Callable[[], None]]:
        """An encoded snapshot decoded into a pooled float32 buffer; ProtocolError (the codec's reason) if any
        value is bad."""
        if self._kept is None or self.receiver is None:
            raise ProtocolError("bad_reply", "an encoded snapshot in a cluster that does not encode")
        buffer, give_back = self._kept.take()
        array = buffer.view(np.float32)
        try:
            self.receiver.decode(raw, peer, header, array, MAX_VALUE)
        except CodecError as exc:
            give_back()
            raise ProtocolError(exc.reason, str(exc)) from None
        return array, give_back


class ReplyReader:
    """Checks snapshot replies and takes hold of their parameters (on one thread: the client thread,
    or the training thread when a small model's fetches run there).

    Args:
        model: what our model looks like on the wire.
        values: the checks every peer's parameters must pass.
        readers: same-host peers whose shared-memory slots we may read (a peer
            is dropped from it, and asked over TCP, once its slots cannot be opened).
        counters: where to count bytes and same-host reads.
        paths: how each peer's snapshot comes (a slot, a stream or the reply's frames: dpwa.gossip.transfer.paths),
            shared with the node's other readers; None: slots from `readers`, no streams.
        sealed: the cluster has CURVE keys: a stream must be sealed (a plain one would bypass the encryption).
        name: this node, for log lines.
        peers: how many peers it may read from (a codec's memory budget: topk keeps a copy per peer).
        spare: the node's own memory to receive a snapshot into (Arrivals).
        members: open membership's view: each request carries its digest (:meth:`outgoing`), and the digest
            each reply carries is merged. None: digests are neither sent nor read.
    """

    def __init__(
        self,
        model: WireModel,
        values: PeerValues,
        readers: dict[str, PeerSlots],
        counters: Counters,
        log: Callable[[str], None],
        paths: PeerPaths | None = None,
        *,
        sealed: bool = False,
        name: str = "dpwa",
        peers: int = 1,
        members: Members | None = None,
        spare: Callable[[], tuple[np.ndarray, Callable[[], None]] | None] | None = None,
    ) -> None:
        self.model = model
        self.members = members
        self.values = values
        self.readers = readers
        self.paths = paths if paths is not None else PeerPaths(slots=readers)
        self._bulk = BulkReceiver(name)
        self._sealed = sealed
        self.name = name
        self._limited = RateLimitedLog()
        # a snapshot that came in chunks or by stream is received into a slot the store lends, or a pooled buffer
        self.arrivals = Arrivals(model, peers, spare)
        self._counters = counters
        self._log = log

    def bulk_failed(
        self, peer: str, why: object, then: str = "fetching over ZeroMQ instead", counter: str = "bulk_fallbacks"
    ) -> None:
        """A stream with `peer` failed (`then`: what happens now): count it, say so, and use no streams with
        that peer for a while (from BULK_PAUSE_S, doubling with each failure in a row)."""
        pause, failures = self.paths.stream_failed(peer, time.monotonic())
        self._counters.add(counter)
        self._limited(
            30,
            ("bulk_fallback", peer),
            "%s: a bulk stream with %s failed (%s); %s, and no stream with %s for %.1f s (%d failed in a row)",
            self.name,
            peer,
            why,
            then,
            peer,
            pause,
            failures,
        )

    def outgoing(self) -> dict[str, Any]:
        """Fields every snapshot request carries besides its own: our view's digest, with open membership."""
        return {"digest": self.members.digest()} if self.members is not None else {}

    def read(self, response: Response, peer: str, deadline: float = math.inf) -> Received:
        """The parameters of a snapshot reply, checked; ProtocolError if unusable (TransportError if a
        bulk transfer fails). A bulk transfer must be in by `deadline`. With open membership the reply's
        digest is merged first: it answered, so it is alive."""
        header = response.header
        if self.members is not None:
            self.members.heard(peer)
            self.members.merge(peer, header.get("digest"))
        check_payload(header, self.model)
        if header.kind == SHM_PARAMS.name:
            received = self._read_slot(header, peer)
        elif header.kind == BULK_PARAMS.name:
            return self._read_bulk(header, peer, deadline)
        else:
            payload = response.frames[0]
            if len(payload) != header["nbytes"]:  # the header's is checked (check_payload)
                raise ProtocolError(
                    "bad_size", f"the payload holds {len(payload)} bytes, the header {header['nbytes']}"
                )
            array, release = self.arrivals.take(payload, header, peer)
            self._counters.add("bytes_in", len(payload))
            received = Received(header, array, release)
        with contextlib.ExitStack() as keep:
            keep.push(received)  # released if the check fails
            self.values.check(received.array)
            keep.pop_all()
        return received

    def read_offer(
        self, header: Header, peer: str, deadline: float, cancelled: Callable[[], bool] = lambda: False
    ) -> Received:
        """The snapshot `peer` offered at its bulk port (a ``bulk_exchange``), streamed in and checked as a
        ``bulk_params`` reply is; ProtocolError if unusable, BulkError if the stream fails."""
        check_payload(header, self.model)
        return self._read_bulk(header, peer, deadline, cancelled)

    def _read_bulk(
        self, header: Header, peer: str, deadline: float, cancelled: Callable[[], bool] = lambda: False
    ) -> Received:
        """Stream the snapshot straight into a pooled buffer, checking each block as it arrives."""
        host = self.paths.host(peer)
        if host is None:
            raise ProtocolError("bad_reply", "a bulk transfer that was not asked for")
        key = header.get("key")
        if self._sealed and key is None:
            raise ProtocolError("bad_reply", "a plain bulk stream in a cluster with keys (it would bypass CURVE)")
        now = time.monotonic()
        first_byte_by = stream_by = now + BULK_FIRST_BYTE_SHARE * max(0.0, deadline - now)
        whole, give_back = self.arrivals.wire.take()
        buffer = whole[: header["nbytes"]]  # a codec's snapshots may vary in size (checked: check_payload)
        with contextlib.ExitStack() as keep:
            keep.callback(give_back)  # given back if anything fails
            if self.model.encoded:  # the values exist once decoded: the scales are checked then, and the values
                self._bulk.receive(
                    host,
                    header["port"],
                    header["token"],
                    buffer,
                    deadline,
                    cancelled=cancelled,
                    key=key,
                    first_byte_by=first_byte_by,
                    stream_by=stream_by,
                )
                array, give_back = self.arrivals.decode(buffer, header, peer)
                keep.pop_all()
                keep.callback(give_back)
                self.values.check(array)
            else:
                array = buffer.view(self.model.storage)
                size = array.itemsize

                def check(start: int, end: int) -> None:
                    self.values.check_values(array[start // size : end // size])

                self._bulk.receive(
                    host,
                    header["port"],
                    header["token"],
                    buffer,
                    deadline,
                    check,
                    cancelled,
                    key=key,
                    first_byte_by=first_byte_by,
                    stream_by=stream_by,
                )
                self.values.check_distance(array)
            keep.pop_all()
        self.paths.stream_worked(peer)
        self._counters.add("bytes_in", buffer.nbytes)
        self._counters.add("bulk_fetches")
        return Received(header, array, give_back)

    def _read_slot(self, header: Header, peer: str) -> Received:
        reader = self.readers.get(peer)
        if reader is None:
            raise ProtocolError("bad_reply", "a shared-memory reply that was not asked for")
        try:
            view = reader.acquire(
                header["shm_id"], header["shm_slot"], header["version"], self.model.kept_nbytes, self.model.storage
            )
        except ProtocolError as exc:
            if exc.reason == "shm_unavailable":  # e.g. the peer runs as another user: use TCP from now on
                self.readers.pop(peer, None)
                self.paths.slot_unreadable(peer)
                reader.close()
                self._log(f"{exc.detail}: falling back to TCP for {peer}")
            raise
        self._counters.add("same_host_fetches")
        self._counters.add("shm_bytes_in", self.model.nbytes)
        return Received(header, view.array, view.release)

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        self._bulk.close()


class FetchTask:
    """Fetch one peer's snapshot (pull mode). Its value is a :class:`Received`."""

    timed = "fetch"  # its deadline follows the link (dpwa.gossip.membership.deadlines), sampled from the call's latency

    def __init__(self, peer: str, deadline: float, name: str, reader: ReplyReader) -> None:
        self.peer, self.deadline = peer, deadline
        self._reader = reader
        self._fields: dict[str, Any] = {"from": name, "fp": reader.model.fingerprint, "dtype": reader.model.dtype}
        if reader.model.rule is not None:
            self._fields["rule"] = reader.model.rule
        if reader.paths.reads_slot(peer):
            self._fields["shm"] = True
        self._bulk: bool | None = None  # ask for a stream? Decided by the reader's thread, at the first request
        self.retries = 0
        self.fallbacks = 0  # streams that failed, and were replaced by a fetch over ZeroMQ

    def first_request(self, request_id: int) -> tuple[list[bytes], dict[str, MessageKind]]:
        """The request run() makes first (so a DirectClient can send it early)."""
        if self._bulk is None:
            self._bulk = self._reader.paths.incoming(self.peer, time.monotonic()) == "stream"
        fields = {**self._fields, "bulk": True} if self._bulk else self._fields
        held = self._reader.arrivals.request(self.peer)  # what the codec holds from the peer (topk)
        return [encode(FETCH, request_id, **fields, **held, **self._reader.outgoing())], SNAPSHOT_REPLIES

    def run(self, ask: Ask) -> Received:
        attempts_left = SAME_HOST_ATTEMPTS
        while True:  # bounded: at most SAME_HOST_ATTEMPTS asks for a slot, and one more after a failed stream
            attempts_left -= 1
            response = ask(lambda rid: self.first_request(rid)[0], SNAPSHOT_REPLIES)
            try:
                return self._reader.read(response, self.peer, self.deadline)
            except BulkError as exc:
                if not self._bulk:
                    raise
                self._reader.bulk_failed(self.peer, exc)
                self._bulk = False  # ask again over ZeroMQ, within the same deadline
                self.fallbacks += 1
                attempts_left += 1
            except ProtocolError as exc:
                if exc.reason not in _RETRY or not attempts_left:
                    raise
                self.retries += 1  # the slot was rewritten between the reply and our lock: ask again


@contextlib.contextmanager
def holding(value: Any) -> Iterator[Any]:
    """Release `value` if the block raises; keep it otherwise (ownership passes on)."""
    try:
        yield value
    except BaseException:
        if value is not None:
            value.release()
        raise
