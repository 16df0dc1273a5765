"""A request channel: one DEALER socket to one endpoint, polled with a deadline, kept across timeouts.

It speaks to a ROUTER as a REQ socket would (an empty delimiter, then the
request), but it is not REQ's strict send/receive state machine: a request
that timed out leaves the socket usable, so the connection and its handshake
survive a slow reply. On a link whose delays straddle the deadline that is
the difference between a slow peer and a silent one: the ZeroMQ guide's
"Lazy Pirate" client (a REQ socket closed and replaced after every timeout)
pays a fresh TCP and ZMTP handshake for every request after the first
timeout, which on such a link itself outlasts the deadline.

* Every reply's request id is checked. A reply to an earlier request (it came
  after that request's deadline) is read and dropped, counted, and told to
  `heard`: the peer is alive, only slow.
* A request that timed out on a socket that heard nothing for
  :data:`KEEP_QUIET_S` (a peer that is down, or not up yet: a fresh socket
  connects at once, where a kept one may be waiting out its reconnect
  back-off) closes it with linger 0, as the Lazy Pirate does. So does one
  whose payload ZeroMQ still held (the connection is down: that memory is
  released now and never sent later), any transport error, and a reply to a
  request this channel never sent, or no longer remembers (``bad_id``).
* Nothing is sent once the deadline has passed.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from .calls import Response
from .errors import DeadlinePassed, ProtocolError, RequestCancelled, RequestTimeout, TransportError
from .payload import CHUNK_BYTES, group, send_frames
from .schema import KINDS, MAX_HEADER_BYTES, MessageKind, decode
from .sockets import FRAME_ALLOWANCE, POLL_SLICE_S, base_options

__all__ = ["KEEP_QUIET_S", "LATE_KEPT", "Channel"]

KEEP_QUIET_S = 5.0  # a timed-out request keeps its socket only if the socket heard a reply this recently
LATE_KEPT = 16  # ids of timed-out requests remembered, whose late replies are dropped (not bad_id)


class Channel:
    """A request client for one endpoint (DEALER, kept across timeouts). Use it from one thread only.

    Args:
        context: the ZeroMQ context to create sockets from.
        endpoint: the server to talk to.
        name: used in error messages ("w1 -> w2").
        max_reply_bytes: the largest frame accepted; ZeroMQ drops a connection
            that sends more, before allocating it.
        socket_options: extra options set on every new socket (CURVE keys, say).
        heard: called (on the owner's thread) whenever any reply arrives, a late one included.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        *,
        name: str = "dpwa",
        max_reply_bytes: int = MAX_HEADER_BYTES,
        socket_options: Mapping[int, Any] | None = None,
        heartbeat_ms: int = 1000,
        heard: Callable[[], None] = lambda: None,
    ) -> None:
        self._ctx = context
        self._heard = heard
        self.late = 0  # replies to earlier requests, read and dropped
        self._late_ids: collections.deque[int] = collections.deque(maxlen=LATE_KEPT)  # requests that timed out
        self._heard_at = -math.inf  # when the socket last received anything
        self._payload_sent: zmq.MessageTracker | None = None  # the last request's payload, until ZeroMQ lets go
        self.endpoint = endpoint
        self.name = name
        self._max_reply_bytes = max_reply_bytes
        self._socket_options = dict(socket_options or {})
        self._heartbeat_ms = heartbeat_ms
        self._sock: zmq.Socket | None = None
        self._rcvtimeo = -1  # the RCVTIMEO set on _sock

    def request(
        self,
        frames: Sequence[Any],
        request_id: int,
        deadline: float,
        *,
        accept: Mapping[str, MessageKind] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Response:
        """Send `frames` and wait until `deadline` for the reply with the same request id.

        `deadline` is a ``time.monotonic()`` value; nothing is sent once it has
        passed (DeadlinePassed). `accept` names the reply kinds expected
        (``error`` always is). Raises RequestTimeout, RequestCancelled,
        DeadlinePassed, ProtocolError (a malformed or unexpected reply) or
        TransportError.
        """
        self.send(frames, request_id, deadline)
        return self.receive(request_id, deadline, accept=accept, cancelled=cancelled)

    def send(self, frames: Sequence[Any], request_id: int, deadline: float) -> None:
        """The first half of :meth:`request`: send `frames` (a request whose id is `request_id`) at once."""
        if time.monotonic() >= deadline:
            raise DeadlinePassed(f"{self.name}: the deadline passed before request {request_id} was sent")
        sock = self._socket()
        try:
            # a REQ socket's envelope (the empty delimiter) and header copied; payload chunks zero-copy, tracked
            self._payload_sent = send_frames(sock, [b"", *frames], flags=zmq.NOBLOCK, track=len(frames) > 1, head=2)
        except zmq.ZMQError as exc:
            self.reset()
            raise TransportError(f"{self.name}: cannot send to {self.endpoint}: {exc}") from exc

    def receive(
        self,
        request_id: int,
        deadline: float,
        *,
        accept: Mapping[str, MessageKind] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Response:
        """The second half of :meth:`request`: the reply to the request just sent, waiting until `deadline`.

        A reply that has already arrived is taken even when the deadline has passed (it came in time).
        Replies to earlier requests are dropped on the way (counted in ``late``).
        """
        sock = self._sock
        if sock is None:
            raise TransportError(f"{self.name}: no request to {self.endpoint} is waiting for its reply")
        # One blocking receive per slice (RCVTIMEO), not a poll and then a receive: a reply costs one call
        # into ZeroMQ, and one hand-over of the GIL, on a thread that shares it with training.
        while True:  # bounded by the deadline: each pass waits at most a slice
            if cancelled():
                self.let_go(request_id)
                raise RequestCancelled(f"{self.name}: request {request_id} to {self.endpoint} cancelled")
            remaining = deadline - time.monotonic()
            wait_ms = max(1, int(min(remaining, POLL_SLICE_S) * 1000)) if remaining > 0 else 0
            try:
                reply = self._receive(sock, wait_ms)
            except zmq.ZMQError as exc:
                self.reset()
                raise TransportError(f"{self.name}: receive from {self.endpoint} failed: {exc}") from exc
            if reply is None and remaining <= 0:  # nothing had arrived by the deadline
                self.let_go(request_id)
                raise RequestTimeout(f"{self.name}: no reply from {self.endpoint} for request {request_id}")
            if reply is None:
                continue
            self._heard_at = time.monotonic()
            self._heard()
            header = self._header(reply, request_id, accept)
            if header is not None:
                break
        try:
            payloads = group(reply[2:], KINDS[header.kind].payload)
        except ProtocolError as exc:
            raise ProtocolError("bad_reply", f"from {self.endpoint}: a {header.kind} reply: {exc.detail}") from None
        return Response(header, payloads)

    def _header(self, reply: list[zmq.Frame], request_id: int, accept: Mapping[str, MessageKind] | None) -> Any:
        """The header of the reply to `request_id`, checked against `accept`; None for the late reply of a
        request that timed out (dropped: the peer is alive, only slow); ProtocolError for anything else."""
        if len(reply) < 2 or len(reply[0]) != 0:
            self.reset()  # not a ROUTER's reply: nothing more on this socket can be trusted to line up
            raise ProtocolError("bad_reply", f"from {self.endpoint}: {len(reply)} frames without the delimiter")
        try:
            header = decode(reply[1].buffer, accept)
        except ProtocolError as exc:
            if exc.reason == "unexpected_kind" and self._late(reply[1].buffer):
                return None  # a late reply of another kind than the one awaited
            raise ProtocolError(exc.reason, f"from {self.endpoint}: {exc.detail}") from None
        if header.id == request_id or (header.kind == "error" and header.id == 0):
            return header
        if self._late(reply[1].buffer, header.id):
            return None
        self.reset()
        raise ProtocolError("bad_id", f"from {self.endpoint}: reply to request {header.id}, expected {request_id}")

    def _late(self, data: memoryview, reply_id: int | None = None) -> bool:
        """Is this reply (its header `data`, or its id when decoded already) the late reply of a request this
        channel let go? Then it is counted and forgotten."""
        if reply_id is None:
            try:
                reply_id = decode(data).id
            except ProtocolError:
                return False
        if reply_id not in self._late_ids:
            return False
        self._late_ids.remove(reply_id)
        self.late += 1
        return True

    def let_go(self, request_id: int) -> None:
        """Request `request_id` will not be waited for: its reply is dropped when it comes (a late one), and
        the socket (with its connection) is kept for the next request, unless it heard nothing for
        KEEP_QUIET_S (a fresh one connects at once) or ZeroMQ still holds the request's payload (the
        connection is down: that memory is released now, and never sent later)."""
        self._late_ids.append(request_id)
        quiet = time.monotonic() - self._heard_at > KEEP_QUIET_S
        if quiet or (self._payload_sent is not None and not self._payload_sent.done):
            self.reset()

    def _receive(self, sock: zmq.Socket, wait_ms: int) -> list[zmq.Frame] | None:
        """A whole message, waiting at most `wait_ms` (0: only one already here); None if none came."""
        if wait_ms == 0:
            try:
                return sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
        if wait_ms != self._rcvtimeo:
            sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._rcvtimeo = wait_ms
        try:
            return sock.recv_multipart(copy=False)  # the later frames of a message arrive with its first
        except zmq.Again:
            return None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            try:
                base_options(sock, self._heartbeat_ms)
                # every frame is a header or one chunk of a payload (dpwa.wire.payload)
                sock.setsockopt(zmq.MAXMSGSIZE, min(self._max_reply_bytes, CHUNK_BYTES) + FRAME_ALLOWANCE)
                sock.setsockopt(zmq.RECONNECT_IVL, 100)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
                if "[" in self.endpoint:
                    sock.setsockopt(zmq.IPV6, 1)
                for option, value in self._socket_options.items():
                    sock.setsockopt(option, value)
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise TransportError(f"{self.name}: cannot connect to {self.endpoint}: {exc}") from exc
            self._sock = sock
            self._rcvtimeo = -1  # ZeroMQ's default: wait forever (every receive here sets its own)
        return self._sock

    def reset(self) -> None:
        """Discard the socket (linger 0: what is queued on it is dropped); the next request opens a fresh one."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._payload_sent = None
        self._late_ids.clear()  # their replies went with the socket
        self._heard_at = -math.inf

    def close(self) -> None:
        self.reset()
