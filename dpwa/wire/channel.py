"""A Lazy-Pirate channel: one REQ socket to one endpoint, polled with a deadline, replaced after a timeout.

This is the "Lazy Pirate" client of the ZeroMQ guide. A REQ socket whose reply
was lost can never send again, and a late reply must never be taken for the
next one: after a timeout the socket is closed with linger 0 and replaced.
Every reply's request id is checked, and nothing is sent once the deadline
has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import zmq

from .calls import Response
from .errors import DeadlinePassed, ProtocolError, RequestCancelled, RequestTimeout, TransportError
from .payload import CHUNK_BYTES, group, send_frames
from .schema import KINDS, MAX_HEADER_BYTES, MessageKind, decode
from .sockets import FRAME_ALLOWANCE, POLL_SLICE_S, base_options

__all__ = ["Channel"]


class Channel:
    """A Lazy-Pirate REQ client for one endpoint. Use it from one thread only.

    Args:
        context: the ZeroMQ context to create sockets from.
        endpoint: the server to talk to.
        name: used in error messages ("w1 -> w2").
        max_reply_bytes: the largest frame accepted; ZeroMQ drops a connection
            that sends more, before allocating it.
        socket_options: extra options set on every new socket (CURVE keys, say).
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
    ) -> None:
        self._ctx = context
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
            send_frames(sock, frames, flags=zmq.NOBLOCK)
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
        """
        sock = self._sock
        if sock is None:
            raise TransportError(f"{self.name}: no request to {self.endpoint} is waiting for its reply")
        # One blocking receive per slice (RCVTIMEO), not a poll and then a receive: a reply costs one call
        # into ZeroMQ, and one hand-over of the GIL, on a thread that shares it with training.
        reply = None
        while reply is None:
            if cancelled():
                self.reset()
                raise RequestCancelled(f"{self.name}: request {request_id} to {self.endpoint} cancelled")
            remaining = deadline - time.monotonic()
            wait_ms = max(1, int(min(remaining, POLL_SLICE_S) * 1000)) if remaining > 0 else 0
            try:
                reply = self._receive(sock, wait_ms)
            except zmq.ZMQError as exc:
                self.reset()
                raise TransportError(f"{self.name}: receive from {self.endpoint} failed: {exc}") from exc
            if reply is None and remaining <= 0:  # nothing had arrived by the deadline
                self.reset()
                raise RequestTimeout(f"{self.name}: no reply from {self.endpoint} for request {request_id}")
        if not reply:
            raise ProtocolError("bad_reply", f"from {self.endpoint}: an empty message")
        try:
            header = decode(reply[0].buffer, accept)
        except ProtocolError as exc:
            raise ProtocolError(exc.reason, f"from {self.endpoint}: {exc.detail}") from None
        if header.id != request_id and not (header.kind == "error" and header.id == 0):
            self.reset()
            raise ProtocolError("bad_id", f"from {self.endpoint}: reply to request {header.id}, expected {request_id}")
        try:
            payloads = group(reply[1:], KINDS[header.kind].payload)
        except ProtocolError as exc:
            raise ProtocolError("bad_reply", f"from {self.endpoint}: a {header.kind} reply: {exc.detail}") from None
        return Response(header, payloads)

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
            sock = self._ctx.socket(zmq.REQ)
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
        """Discard the socket (linger 0); the next request opens a fresh one."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self.reset()
