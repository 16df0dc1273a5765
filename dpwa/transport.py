"""ZeroMQ transport: a request server and a request client, each owned by one thread.

* :class:`Server` runs one thread that owns a ROUTER socket. It reads requests,
  checks their envelope and header, and dispatches them by ``kind`` to
  handlers, so one port can carry several kinds of request. It never blocks on
  a peer: replies are sent with ``NOBLOCK``; a peer whose queue is full (two
  unread replies), or who is gone, loses its reply and nobody else notices.
  Payloads are sent without a copy and stay leased until ZeroMQ reports them
  sent, so a peer that never reads holds at most a snapshot slot, never the
  serving thread.

* :class:`Requester` is the "Lazy Pirate" client of the ZeroMQ guide: a REQ
  socket per endpoint, polled with a deadline. After a timeout it is closed
  with linger 0 and replaced, because a REQ socket whose reply was lost can
  never send again, and a late reply must never be taken for the next one.
  Every reply's request id is checked too.

With :class:`Curve` keys, every connection is encrypted and authenticated
(ZeroMQ CURVE). The server thread also answers ZeroMQ's authentication (ZAP)
requests itself: a client whose public key is not in the allowed set is
refused during the handshake, never reaches a handler, and is counted
(``auth_denied``) and logged. A socket monitor counts handshakes that fail
before authentication (a client without CURVE, say) as ``handshakes_failed``.

Neither class knows what a model is; :mod:`dpwa.node` supplies the handlers.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import zmq
import zmq.utils.monitor
import zmq.utils.z85

from .logs import RateLimitedLog, logger
from .protocol import MAX_HEADER_BYTES, Header, ProtocolError, decode_header, encode_header
from .snapshot import Lease
from .stats import Counters

__all__ = [
    "Curve",
    "is_local_host",
    "Reply",
    "Request",
    "Requester",
    "RequestCancelled",
    "RequestTimeout",
    "Server",
    "TransportError",
]

POLL_SLICE_S = 0.05  # how often blocked loops look at their stop / cancel flags
# ZMQ_MAXMSGSIZE applies to a message as it arrives, and a CURVE-encrypted frame is
# longer than its plaintext (command name, nonce, MAC): limits get this allowance.
FRAME_ALLOWANCE = 256


class TransportError(RuntimeError):
    """A transport operation failed; the message names the endpoint."""


class RequestTimeout(TransportError):
    """No reply came before the deadline."""


class RequestCancelled(TransportError):
    """The caller gave up on the request before it completed."""


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks for authentication (RFC 27)


@dataclass(frozen=True)
class Curve:
    """CURVE keys of one node: its own pair, and who may talk to it."""

    public: bytes  # this node's public key, Z85
    secret: bytes  # this node's secret key, Z85
    allowed: Mapping[bytes, str] = field(default_factory=dict)  # raw 32-byte client key -> node name

    def server_options(self) -> dict[int, Any]:
        return {zmq.CURVE_SERVER: 1, zmq.CURVE_PUBLICKEY: self.public, zmq.CURVE_SECRETKEY: self.secret,
                zmq.ZAP_DOMAIN: b"dpwa"}

    def client_options(self, server_public: bytes) -> dict[int, Any]:
        return {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: self.public,
                zmq.CURVE_SECRETKEY: self.secret}


@dataclass
class Request:
    """One validated request, as a handler sees it."""

    header: Header
    payload: Sequence[zmq.Frame]  # frames after the header (empty for most kinds)
    peer: bytes  # the ROUTER routing id of the sender (opaque)


@dataclass
class Reply:
    """What a handler answers: an encoded header, optionally one payload buffer."""

    header: bytes
    payload: Any = None  # a buffer (numpy array, bytes); sent without a copy
    lease: Lease | None = None  # released once the payload has left, or if it cannot be sent


Handler = Callable[[Request], Reply]


def is_local_host(host: str) -> bool:
    """True if `host` names this machine: a loopback address, or an address of a local interface."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        address = sockaddr[0]
        try:
            if ipaddress.ip_address(address.split("%")[0]).is_loopback:
                return True
        except ValueError:
            continue
        try:  # an address this machine can bind is one of its own
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False


def _base_options(sock: zmq.Socket, heartbeat_ms: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Detect dead or stalled connections: without a PONG within the timeout the
    # connection is dropped, and payloads queued for it are released.
    sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * heartbeat_ms)


class Server:
    """Serves requests on one endpoint from one thread that owns the ROUTER socket.

    Args:
        context: the ZeroMQ context to create the socket from.
        endpoint: where to bind, like ``tcp://127.0.0.1:45000``.
        handlers: request kind -> function that returns a :class:`Reply`.
        name: used in log messages and thread names.
        max_request_bytes: larger inbound frames make ZeroMQ drop the connection
            before the frame is allocated.
        counters: where to count served and rejected requests.
        curve: encrypt, and serve only the clients whose keys it allows.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        handlers: Mapping[str, Handler],
        *,
        name: str = "dpwa",
        max_request_bytes: int = MAX_HEADER_BYTES,
        counters: Counters | None = None,
        curve: Curve | None = None,
        heartbeat_ms: int = 1000,
    ) -> None:
        self._ctx = context
        self.endpoint = endpoint
        self._handlers = dict(handlers)
        self.name = name
        self._max_request_bytes = max_request_bytes
        self.counters = counters or Counters()
        self._curve = curve
        self._heartbeat_ms = heartbeat_ms
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"dpwa-rx-{name}", daemon=True)
        self._log = RateLimitedLog()

    def start(self, timeout_s: float = 10.0) -> "Server":
        """Start the thread and wait until the socket is bound; raise if binding fails."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.close()
            raise TransportError(f"{self.name}: the Rx thread did not bind {self.endpoint} within {timeout_s} s")
        if self._error is not None:
            self._thread.join(timeout_s)
            exc = self._error
            hint = ""
            if isinstance(exc, zmq.ZMQError) and exc.errno == errno.EADDRINUSE:
                hint = " (another process, or another node of this config, is using that port)"
            elif isinstance(exc, zmq.ZMQError) and exc.errno == errno.EADDRNOTAVAIL:
                hint = " (that address is not one of this machine's; set the node's 'bind' key, e.g. '*')"
            raise TransportError(f"{self.name}: cannot bind {self.endpoint}: {exc}{hint}") from exc
        return self

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread and close the socket (linger 0). True if the thread ended in time."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("%s: Rx thread still running %.1f s after close(); it is a daemon and will die with the process",
                         self.name, timeout_s)
            return False
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        sockets: list[zmq.Socket] = []
        try:
            try:
                sock = self._ctx.socket(zmq.ROUTER)
                sockets.append(sock)
                zap = monitor = None
                if self._curve is not None:
                    # The authentication handler must exist before the first handshake.
                    zap = self._ctx.socket(zmq.REP)
                    sockets.append(zap)
                    zap.setsockopt(zmq.LINGER, 0)
                    zap.bind(ZAP_ENDPOINT)
                _base_options(sock, self._heartbeat_ms)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished peer is an error, not a block
                sock.setsockopt(zmq.MAXMSGSIZE, self._max_request_bytes + FRAME_ALLOWANCE)
                sock.setsockopt(zmq.SNDHWM, 2)
                sock.setsockopt(zmq.RCVHWM, 64)
                if "[" in self.endpoint:
                    sock.setsockopt(zmq.IPV6, 1)
                if self._curve is not None:
                    for option, value in self._curve.server_options().items():
                        sock.setsockopt(option, value)
                    monitor = sock.get_monitor_socket(
                        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
                    sockets.append(monitor)
                sock.bind(self.endpoint)
            except zmq.ZMQError as exc:
                self._error = exc
                return
            finally:
                self._ready.set()
            poller = zmq.Poller()
            for s in (sock, zap, monitor):
                if s is not None:
                    poller.register(s, zmq.POLLIN)
            while not self._stop.is_set():
                ready = dict(poller.poll(int(POLL_SLICE_S * 1000)))
                if zap is not None and zap in ready:
                    self._authenticate(zap)
                if monitor is not None and monitor in ready:
                    self._handshake_event(monitor)
                if sock in ready:
                    for _ in range(64):  # bounded, so the stop flag is seen under load
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        try:
                            self._handle(sock, frames)
                        except zmq.ContextTerminated:
                            raise
                        except Exception:  # one message must never stop the server
                            self.counters.add("requests_rejected")
                            self.counters.add("rejected.internal")
                            logger.exception("%s: failed to handle a request; serving on", self.name)
        except zmq.ContextTerminated:
            pass
        except Exception:  # a bug here must be loud, but must not hang close()
            logger.exception("%s: Rx thread failed", self.name)
        finally:
            if len(sockets) > 2:
                try:
                    sockets[0].disable_monitor()
                except zmq.ZMQError:
                    pass
            for s in reversed(sockets):
                s.close(linger=0)

    def _authenticate(self, zap: zmq.Socket) -> None:
        """Answer one ZAP request (RFC 27): allow exactly the configured CURVE keys."""
        frames = zap.recv_multipart()
        if len(frames) < 6:  # not from libzmq; a REP socket must still answer
            zap.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
            return
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        name = None
        if mechanism == b"CURVE" and len(credentials) == 1:
            name = self._curve.allowed.get(credentials[0])
        if name is not None:
            zap.send_multipart([version, request_id, b"200", b"OK", name.encode(), b""])
            return
        self.counters.add("auth_denied")
        key = zmq.utils.z85.encode(credentials[0]).decode() if len(credentials) == 1 and len(credentials[0]) == 32 else "?"
        self._log(30, ("auth", key), "%s: refused a %s connection from %s with public key %s: not in the config",
                  self.name, mechanism.decode(errors="replace"), address.decode(errors="replace"), key)
        zap.send_multipart([version, request_id, b"400", b"key not allowed", b"", b""])

    def _handshake_event(self, monitor: zmq.Socket) -> None:
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        self.counters.add("handshakes_failed")
        self._log(30, ("handshake", event["event"]), "%s: a connection failed its handshake (%s); "
                  "a peer without the right CURVE settings?", self.name, zmq.Event(event["event"]).name)

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        # A REQ client's message reaches a ROUTER as [routing id, b"", header, *payload].
        if len(frames) < 3 or len(frames[1]) != 0:
            self._reject("bad_envelope", f"{len(frames)} frames without the REQ delimiter", None)
            return
        peer = frames[0].bytes
        try:
            header = decode_header(frames[2].buffer)
        except ProtocolError as exc:
            self._reject(exc.reason, exc.detail, None)
            self._send(sock, peer, Reply(encode_header("error", 0, reason=exc.reason, detail=exc.detail)))
            return
        handler = self._handlers.get(header.kind)
        if handler is None:
            self._reply_error(sock, peer, header, "unexpected_kind", f"this node does not serve {header.kind!r} requests")
            return
        try:
            reply = handler(Request(header, frames[3:], peer))
        except ProtocolError as exc:
            self._reply_error(sock, peer, header, exc.reason, exc.detail)
            return
        except Exception as exc:
            logger.exception("%s: handler for %r failed", self.name, header.kind)
            self._reply_error(sock, peer, header, "internal", f"{type(exc).__name__}", reject=False)
            return
        self.counters.add("requests_served")
        self._send(sock, peer, reply)

    def _reply_error(self, sock: zmq.Socket, peer: bytes, header: Header, reason: str, detail: str,
                     reject: bool = True) -> None:
        if reject:
            self._reject(reason, detail, header)
        self._send(sock, peer, Reply(encode_header("error", header.id, reason=reason, detail=detail)))

    def _reject(self, reason: str, detail: str, header: Header | None) -> None:
        self.counters.add("requests_rejected")
        self.counters.add(f"rejected.{reason}")
        sender = header.fields.get("from", "?") if header is not None else "?"
        self._log(30, ("reject", reason), "%s: rejected a request from %s: %s: %s", self.name, sender, reason, detail)

    def _send(self, sock: zmq.Socket, peer: bytes, reply: Reply) -> None:
        parts = [peer, b"", reply.header]
        tracked = reply.payload is not None
        if tracked:
            parts.append(reply.payload)
        try:
            tracker = sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False, track=tracked)
        except zmq.ZMQError as exc:  # EAGAIN: that peer's queue is full; EHOSTUNREACH: it is gone
            self.counters.add("replies_dropped")
            self._log(30, ("drop", exc.errno), "%s: dropped a reply: %s", self.name, exc)
            if reply.lease is not None:
                reply.lease.release()
            return
        if tracked:
            self.counters.add("bytes_out", memoryview(reply.payload).nbytes)
            if reply.lease is not None:
                reply.lease.release_when(tracker)
        elif reply.lease is not None:
            reply.lease.release()


class Requester:
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

    def request(
        self,
        frames: Sequence[Any],
        request_id: int,
        deadline: float,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[Header, list[zmq.Frame]]:
        """Send `frames` and wait for the reply with the same request id until `deadline`.

        `deadline` is a ``time.monotonic()`` value. Returns the reply's header
        and the frames after it. Raises RequestTimeout, RequestCancelled,
        ProtocolError (a malformed reply) or TransportError.
        """
        sock = self._socket()
        try:
            sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self.reset()
            raise TransportError(f"{self.name}: cannot send to {self.endpoint}: {exc}") from exc
        while True:
            if cancelled():
                self.reset()
                raise RequestCancelled(f"{self.name}: request {request_id} to {self.endpoint} cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.reset()
                raise RequestTimeout(f"{self.name}: no reply from {self.endpoint} for request {request_id}")
            if sock.poll(max(1, int(min(remaining, POLL_SLICE_S) * 1000))):
                break
        try:
            reply = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self.reset()
            raise TransportError(f"{self.name}: receive from {self.endpoint} failed: {exc}") from exc
        if not reply:
            raise ProtocolError("bad_reply", f"from {self.endpoint}: an empty message")
        try:
            header = decode_header(reply[0].buffer)
        except ProtocolError as exc:
            raise ProtocolError(exc.reason, f"from {self.endpoint}: {exc.detail}") from None
        if header.id != request_id and not (header.kind == "error" and header.id == 0):
            self.reset()
            raise ProtocolError("bad_id", f"from {self.endpoint}: reply to request {header.id}, expected {request_id}")
        return header, reply[1:]

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            try:
                _base_options(sock, self._heartbeat_ms)
                sock.setsockopt(zmq.MAXMSGSIZE, self._max_reply_bytes + FRAME_ALLOWANCE)
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
        return self._sock

    def reset(self) -> None:
        """Discard the socket (linger 0); the next request opens a fresh one."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self.reset()
