"""Payloads on the wire: a large buffer travels as frames of at most :data:`CHUNK_BYTES`.

Why chunks: libzmq hands a received frame over whole, in memory it allocated
for that frame alone. For a model-sized frame that is a fresh mapping the
kernel must fault in page by page, and unmap afterwards; sent as 1 MiB frames
the same bytes reuse the allocator's memory and arrive in 0.6x the time of
one frame (44.7 MB on loopback: 21 ms against 36 ms, raw TCP 15.5 ms; under
CURVE 56 ms against 114 ms; ``python -m dpwa.bench``). A side effect: no
frame, and so no buffer a peer makes a node allocate, is larger than a chunk
(``ZMQ_MAXMSGSIZE``).

The layout needs no lengths in the header: a payload of n bytes is
``n // CHUNK_BYTES`` full chunks followed by one shorter chunk (possibly
empty), so each payload ends at its first frame shorter than a chunk. A
payload of less than a chunk is one frame, exactly as before.

The receiving side gets a :class:`Payload`: one frame, read in place, or
several, copied into a buffer the reader owns (:meth:`Payload.copy_into`).
:class:`BufferPool` keeps such buffers for reuse, so a steady stream of
exchanges allocates (and faults in) nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import zmq

from .errors import ProtocolError

__all__ = ["Hold", "CHUNK_BYTES", "BufferPool", "Payload", "chunks", "group", "send_frames"]

CHUNK_BYTES = 1 << 20  # measured fastest among 256 KiB .. 4 MiB (dpwa.wire.payload's docstring)


def chunks(buffers: Iterable[Any], chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """The frames that carry `buffers`: each cut into full chunks and one shorter (possibly empty) last one.

    Small buffers are passed through as they are; larger ones become zero-copy memoryview slices.
    """
    for buffer in buffers:
        view = memoryview(buffer)
        if view.nbytes < chunk_bytes:
            yield buffer
            continue
        flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        full = flat.nbytes - flat.nbytes % chunk_bytes
        for offset in range(0, full, chunk_bytes):
            yield flat[offset : offset + chunk_bytes]
        yield flat[full:]


def send_frames(
    sock: zmq.Socket, parts: Sequence[Any], *, flags: int = 0, track: bool = False, head: int = 1
) -> zmq.MessageTracker | None:
    """Send `parts` as one message: `head` small frames (an envelope, a header), copied, then payload
    buffers in chunks, without copies.

    With `track`, the returned tracker is done once ZeroMQ has let go of every
    payload chunk. Only the first frame can fail for lack of room (ZeroMQ admits
    a message whole), so a refusal leaves nothing half-sent.
    """
    frames = list(parts[:head])
    copied = len(frames)
    frames += chunks(parts[head:])
    trackers = []
    last = len(frames) - 1
    flags, more = int(flags), int(zmq.SNDMORE)  # plain ints: or-ing pyzmq's enum flags costs a microsecond each
    for i, frame in enumerate(frames):
        if i < copied:
            sock.send(frame, flags | more if i < last else flags, copy=True)
        else:
            tracker = sock.send(frame, flags | more if i < last else flags, copy=False, track=track)
            if track and tracker is not None and not tracker.done:
                trackers.append(tracker)
    if not track:
        return None
    if len(trackers) == 1:
        return trackers[0]
    return zmq.MessageTracker(*trackers)


class Hold(Protocol):
    """Memory a reply's payload lives in, held until the payload has left."""

    def release(self) -> None: ...

    def release_when(self, tracker: zmq.MessageTracker) -> None: ...


class Payload:
    """One payload as received: its frames (each at most a chunk) and its size."""

    __slots__ = ("frames", "nbytes")

    def __init__(self, frames: Sequence[zmq.Frame]) -> None:
        self.frames = list(frames)
        self.nbytes = sum(len(frame) for frame in self.frames)

    def __len__(self) -> int:
        return self.nbytes

    @property
    def single(self) -> bool:
        """True when the payload is one frame, readable in place."""
        return len(self.frames) == 1

    @property
    def buffer(self) -> memoryview:
        """The bytes, contiguous: the frame itself when there is one, else a copy."""
        if self.single:
            return self.frames[0].buffer
        out = np.empty(self.nbytes, np.uint8)
        self.copy_into(out)
        return out.data

    def copy_into(self, out: np.ndarray) -> None:
        """Copy the bytes into `out` (any contiguous array of exactly `nbytes` bytes)."""
        flat = out.reshape(-1).view(np.uint8)
        if flat.nbytes != self.nbytes:
            raise ValueError(f"a buffer of {flat.nbytes} bytes for a payload of {self.nbytes}")
        offset = 0
        for frame in self.frames:
            n = len(frame)
            flat[offset : offset + n] = np.frombuffer(frame.buffer, np.uint8)
            offset += n

    def array(self, dtype: np.dtype | type, pool: BufferPool | None = None) -> tuple[np.ndarray, Callable[[], None]]:
        """The payload as a flat array of `dtype`, and how to let go of it.

        One frame is read in place (letting go drops the frame); several are
        copied into a buffer of `pool` (letting go returns it), or a new one.
        """
        if self.single:
            frames = self.frames
            return np.frombuffer(frames[0].buffer, dtype), frames.clear
        if pool is not None and pool.nbytes == self.nbytes:
            buffer, release = pool.take()
        else:
            buffer, release = np.empty(self.nbytes, np.uint8), _nothing
        self.copy_into(buffer)
        self.frames.clear()  # the chunks are copied: free them now
        return buffer.view(dtype), release


def _nothing() -> None:
    pass


def group(frames: Sequence[zmq.Frame], count: int, chunk_bytes: int = CHUNK_BYTES) -> list[Payload]:
    """Split a message's payload frames into `count` payloads; ProtocolError if they do not make exactly that."""
    payloads: list[Payload] = []
    start = 0
    for i, frame in enumerate(frames):
        n = len(frame)
        if n > chunk_bytes:
            raise ProtocolError("bad_frames", f"a payload frame of {n} bytes, more than a chunk ({chunk_bytes})")
        if n < chunk_bytes:
            payloads.append(Payload(frames[start : i + 1]))
            start = i + 1
    if start != len(frames) or len(payloads) != count:
        raise ProtocolError(
            "bad_frames",
            f"{len(frames)} payload frames make {len(payloads)} payloads"
            + (" and an unfinished one" if start != len(frames) else "")
            + f", expected {count}",
        )
    return payloads


class BufferPool:
    """Reusable receive buffers of one size, shared by the threads that take and return them.

    :meth:`take` gives a free buffer, or a new one when all are out (so it
    never blocks; how many are out at once is bounded by the taker); at most
    `keep` returned buffers are kept, the rest are freed.

    With `spare` (memory its owner lends: a node's snapshot slot that nobody
    holds, ``SnapshotStore.borrow``), :meth:`take` borrows that first, and
    makes a buffer of its own only when none is lent; it then keeps none
    (`keep` is 0), so the memory of a node stays its slots' between exchanges.
    """

    def __init__(
        self,
        nbytes: int,
        keep: int = 2,
        spare: Callable[[], tuple[np.ndarray, Callable[[], None]] | None] | None = None,
    ) -> None:
        self.nbytes = nbytes
        self._spare = spare
        self._keep = 0 if spare is not None else keep
        self.borrowed = 0  # buffers taken from `spare`
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.out = 0  # buffers taken and not given back now
        self.most_out = 0  # the most ever out at once (docs/design.md#memory: the receive buffers a node holds)

    def take(self) -> tuple[np.ndarray, Callable[[], None]]:
        """A buffer of `nbytes` bytes and the function that returns it (idempotent)."""
        lent = self._spare() if self._spare is not None else None
        if lent is not None:
            array, return_it = lent
            if array.nbytes == self.nbytes:
                with self._lock:
                    self.borrowed += 1
                return array.view(np.uint8), return_it
            return_it()  # (not this size: never, where the owner lends the right memory)
        with self._lock:
            buffer = self._free.pop() if self._free else None
            self.out += 1
            self.most_out = max(self.most_out, self.out)
        if buffer is None:
            buffer = np.empty(self.nbytes, np.uint8)
        out = [buffer]  # emptied when given back, so a second call does nothing

        def give_back() -> None:
            with self._lock:
                if out:
                    self.out -= 1
                    if len(self._free) < self._keep:
                        self._free.append(out[0])
                out.clear()

        return buffer, give_back

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
