"""The serving half of the transport: one thread that owns a ROUTER socket and dispatches requests.

A :class:`Server` binds one endpoint and answers requests by kind: each
:class:`Route` names a message kind (its schema), the handler that answers
it, and the most payload bytes a request of that kind may carry. So any
service (a gossip node, a sync-SGD master, a parameter server) is a set of
routes, and nothing here knows what a model is.

What a client can make the server do is bounded, whoever the client is:

* **Cheap checks first.** The envelope, the header's size (before parsing),
  its schema (every field range-checked), the number and size of payload
  frames, and the sender's identity are checked before a handler runs.
  ZeroMQ drops a connection whose frame exceeds the largest any route takes
  (``ZMQ_MAXMSGSIZE``) before allocating it.
* **Who is asking.** With CURVE, the ZAP handler (run in this same thread)
  admits only listed keys and names each connection after its key's node; a
  request whose ``from`` field names another node is rejected. Without
  CURVE, ``from`` must at least name a known sender. With open membership
  (``CurveKeys.open``) the listed keys change as members come and go, so a
  connection is named by its key and each request by whose key it is at
  the time; a node that takes newcomers lets any key complete the handshake,
  but a key that is no member's reaches only the routes marked
  ``newcomers``, whose handlers admit it only on a certificate for that key.
* **Replies nobody reads.** Replies go out with ``NOBLOCK``: a client whose
  queue is full (``SNDHWM``) loses its reply, and nobody else waits. Replies
  that carry a payload are sent without a copy and their memory stays held
  (:class:`Hold`) until ZeroMQ reports it sent; a sender (its CURVE identity,
  else the node its checked ``from`` names) may have at most
  ``max_unsent_per_client`` such replies unsent, and all together
  ``max_unsent``. Handlers of bulk routes read ``request.may_send_payload``
  and refuse ``busy`` early (a reply without a payload, such as a same-host
  slot's name, still goes); the server refuses a payload reply beyond it
  anyway. So a client that never reads pins a bounded number of buffers, and
  only its own name's budget.
* **Refusals are not failures.** A handler raises :class:`Refused` for an
  ordinary "not now" (busy, not ready) and :class:`ProtocolError` for a bad
  request; both become ``error`` replies, counted apart.

What libzmq cannot bound is the frames of a multipart message that never
ends: it buffers them all before the message reaches us. Only authentication
keeps such a client out, which is why dpwa refuses to serve TCP without CURVE
unless told ``insecure: true`` (see :mod:`dpwa.config`), and serves loopback
clusters over ipc sockets only its own user can open.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.utils.monitor
import zmq.utils.z85

from ..logs import RateLimitedLog, logger
from ..stats import Counters
from .curve import KEY_IDENTITY, CurveKeys
from .endpoints import EndpointInUse, EndpointLock
from .errors import EncodeError, ProtocolError, Refused, TransportError, refused
from .payload import CHUNK_BYTES, Hold, Payload, group, send_frames
from .schema import MAX_HEADER_BYTES, Header, MessageKind, decode, error_header
from .sockets import BULK_RCVHWM, FRAME_ALLOWANCE, POLL_SLICE_S, SNDHWM, base_options

__all__ = ["Reply", "Request", "Route", "Server"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks for authentication (RFC 27)


@dataclass
class Request:
    """One validated request, as a handler sees it."""

    header: Header
    payload: Sequence[Payload]  # the kind's payloads, exactly as many as it declares (most: none)
    client: bytes  # the ROUTER routing id of the connection (opaque)
    identity: str | None  # the node its CURVE key belongs to; None without CURVE (or a newcomer's key)
    # False when the sender has its budget of unsent payload replies: answer without a payload
    # (a same-host slot, say), or refuse "busy" (the server refuses a payload reply anyway)
    may_send_payload: bool = True
    # open membership with CURVE: the connection's client key (Z85), whoever it belongs to; the handlers
    # that take newcomers (identity None) check that the entry a newcomer announces carries this key
    key: str | None = None

    @property
    def sender(self) -> str:
        """Who is asking: the authenticated name, else the checked ``from`` field, else '?'."""
        return self.identity or self.header.get("from") or "?"


@dataclass
class Reply:
    """What a handler answers: an encoded header and payload buffers, sent without a copy."""

    header: bytes
    payload: Sequence[Any] = ()
    hold: Hold | None = None  # released once the payload has left, or if it cannot be sent


@dataclass(frozen=True)
class Route:
    """How a server answers one kind of request."""

    kind: MessageKind
    handler: Callable[[Request], Reply]
    max_payload_bytes: int = 0  # the most payload bytes a request of this kind may carry
    bulk: bool = False  # replies carry a payload: subject to the unsent-reply budget
    # open membership with CURVE: a key that is no member's (identity None, Request.key set) may ask this;
    # the handler must check that the requester's entry carries that key. Every other route refuses it.
    newcomers: bool = False


@dataclass
class _Unsent:
    """Trackers of payload replies not yet sent, per client key (identity or routing id)."""

    per_client: dict[Any, list[zmq.MessageTracker]] = field(default_factory=dict)

    def count(self, key: Any) -> int:
        trackers = self.per_client.get(key)
        if not trackers:
            return 0
        trackers[:] = [t for t in trackers if not t.done]
        if not trackers:
            del self.per_client[key]
        return len(trackers)

    def total(self) -> int:
        return sum(self.count(key) for key in list(self.per_client))

    def add(self, key: Any, tracker: zmq.MessageTracker) -> None:
        self.per_client.setdefault(key, []).append(tracker)


class Server:
    """Serves requests on one endpoint from one thread that owns the ROUTER socket.

    Args:
        context: the ZeroMQ context to create the socket from.
        endpoint: where to bind (``tcp://127.0.0.1:45000``, ``ipc:///...``).
        routes: the request kinds served, by kind name.
        name: used in log messages and thread names.
        counters: where to count served, refused and rejected requests.
        curve: encrypt, and serve only the clients whose keys it allows.
        senders: without CURVE, the names a request's ``from`` may give (None: any); a collection is copied, any
            other container (a node's view of its members, which changes) is asked as it is.
        max_unsent_per_client, max_unsent: the unsent bulk-reply budget (see the module docstring).
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        routes: Mapping[str, Route],
        *,
        name: str = "dpwa",
        counters: Counters | None = None,
        curve: CurveKeys | None = None,
        senders: Container[str] | None = None,
        max_unsent_per_client: int = 2,
        max_unsent: int = 8,
        heartbeat_ms: int = 1000,
        heard: Callable[[str], None] | None = None,
    ) -> None:
        self._ctx = context
        self._heard = heard  # told the sender of each request that passed the checks (a sign it is alive)
        self.endpoint = endpoint
        self._routes = dict(routes)
        self._accept = {r.kind.name: r.kind for r in self._routes.values()}
        self.name = name
        self.counters = counters or Counters()
        self._curve = curve
        self._senders: Container[str] | None = frozenset(senders) if isinstance(senders, Collection) else senders
        self._max_unsent_per_client = max_unsent_per_client
        self._max_unsent = max_unsent
        self._heartbeat_ms = heartbeat_ms
        self._unsent = _Unsent()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"dpwa-rx-{name}", daemon=True)
        self._log = RateLimitedLog()
        self._claim: EndpointLock | None = None  # an ipc endpoint's lock, held while the socket may be bound

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame any route accepts (ZMQ_MAXMSGSIZE, before the CURVE allowance).

        A header, or one chunk of a payload (dpwa.wire.payload): never more than a chunk.
        """
        largest = max((r.kind.max_header_bytes for r in self._routes.values()), default=MAX_HEADER_BYTES)
        chunk = min(CHUNK_BYTES, max((r.max_payload_bytes for r in self._routes.values()), default=0))
        return max(largest, chunk)

    def start(self, timeout_s: float = 10.0) -> Server:
        """Start the thread and wait until the socket is bound; raise TransportError if binding fails.

        An ``ipc://`` endpoint is locked first (dpwa.wire.endpoints.EndpointLock): libzmq would silently
        take over another process's socket file, where a TCP bind fails. The lock is released, and the
        endpoint's files removed, by close().
        """
        if self.endpoint.startswith("ipc://"):
            try:
                self._claim = EndpointLock(self.endpoint)
            except EndpointInUse as in_use:
                raise TransportError(
                    f"{self.name}: cannot bind {in_use} (another process, or another node of this config, "
                    "is using that port)"
                ) from None
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.close()
            raise TransportError(f"{self.name}: the Rx thread did not bind {self.endpoint} within {timeout_s} s")
        if self._error is not None:
            self.close(timeout_s)  # the thread has ended: this releases the endpoint's lock
            exc = self._error
            hint = ""
            if isinstance(exc, zmq.ZMQError) and exc.errno == errno.EADDRINUSE:
                hint = " (another process, or another node of this config, is using that port)"
            elif isinstance(exc, zmq.ZMQError) and exc.errno == errno.EADDRNOTAVAIL:
                hint = " (that address is not one of this machine's; set the node's 'bind' key, e.g. '*')"
            raise TransportError(f"{self.name}: cannot bind {self.endpoint}: {exc}{hint}") from exc
        return self

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread and close the socket (linger 0). True if the thread ended in time.

        Replies still queued are dropped; their holds are released as ZeroMQ frees them.
        """
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("%s: Rx thread still running %.1f s after close(); it is a daemon", self.name, timeout_s)
            return False
        if self._claim is not None:  # the socket is closed: its endpoint may go
            self._claim.close()
            self._claim = None
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ----------------------------------------------------------------- the thread

    def _open(self, sockets: list[zmq.Socket]) -> tuple[zmq.Socket, zmq.Socket | None, zmq.Socket | None]:
        sock = self._ctx.socket(zmq.ROUTER)
        sockets.append(sock)
        zap = monitor = None
        if self._curve is not None:
            # The authentication handler must exist before the first handshake.
            zap = self._ctx.socket(zmq.REP)
            sockets.append(zap)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(ZAP_ENDPOINT)
        base_options(sock, self._heartbeat_ms)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished peer is an error, not a block
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes + FRAME_ALLOWANCE)
        # Queued replies per connection. Payload replies are bounded by the unsent budget below it;
        # a very low mark makes libzmq refuse sends spuriously under load (it learns late that
        # the I/O thread has drained the queue).
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, BULK_RCVHWM if self.max_frame_bytes > 1 << 16 else 64)
        if "[" in self.endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        if self._curve is not None:
            for option, value in self._curve.server_options().items():
                sock.setsockopt(option, value)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            )
            sockets.append(monitor)
        sock.bind(self.endpoint)
        return sock, zap, monitor

    def _run(self) -> None:
        sockets: list[zmq.Socket] = []
        try:
            try:
                sock, zap, monitor = self._open(sockets)
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
                    self._drain(sock)
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

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(64):  # bounded, so the stop flag is seen under load
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(sock, frames)
            except zmq.ContextTerminated:
                raise
            except Exception:  # one message must never stop the server
                self._count_rejected("internal")
                logger.exception("%s: failed to handle a request; serving on", self.name)

    def _authenticate(self, zap: zmq.Socket) -> None:
        """Answer one ZAP request (RFC 27): allow exactly the configured CURVE keys."""
        assert self._curve is not None
        frames = zap.recv_multipart()
        if len(frames) < 6:  # not from libzmq; a REP socket must still answer
            zap.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
            return
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        name = None
        curve = self._curve
        if mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            name = curve.allowed.get(credentials[0])
            if curve.open and (name is not None or curve.newcomers):
                if name is None:
                    self.counters.add("auth_newcomers")
                name = KEY_IDENTITY + zmq.utils.z85.encode(credentials[0]).decode()
        if name is not None:
            zap.send_multipart([version, request_id, b"200", b"OK", name.encode(), b""])
            return
        self.counters.add("auth_denied")
        key = "?"
        if len(credentials) == 1 and len(credentials[0]) == 32:
            key = zmq.utils.z85.encode(credentials[0]).decode()
        self._log(
            30,
            "auth",
            "%s: refused a %s connection from %s with public key %s: %s",
            self.name,
            mechanism.decode(errors="replace"),
            address.decode(errors="replace"),
            key,
            "no member's (this node takes no newcomers)" if curve.open else "not in the config",
        )
        zap.send_multipart([version, request_id, b"400", b"key not allowed", b"", b""])

    def _handshake_event(self, monitor: zmq.Socket) -> None:
        event = zmq.utils.monitor.recv_monitor_message(monitor)
        self.counters.add("handshakes_failed")
        self._log(
            30,
            ("handshake", event["event"]),
            "%s: a connection failed its handshake (%s); a peer without the right CURVE settings?",
            self.name,
            zmq.Event(event["event"]).name,
        )

    def _handle(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        # A REQ client's message reaches a ROUTER as [routing id, b"", header, *payload].
        if len(frames) < 3 or len(frames[1]) != 0:
            self._count_rejected("bad_envelope", f"{len(frames)} frames without the REQ delimiter")
            return
        client = frames[0].bytes
        user = frames[2].get("User-Id") if self._curve is not None else None
        identity = user if isinstance(user, str) and user else None
        key = None
        if identity is not None and identity.startswith(KEY_IDENTITY):  # open membership: whose key is it now?
            assert self._curve is not None
            key = identity[len(KEY_IDENTITY) :]
            identity = self._curve.allowed.get(zmq.utils.z85.decode(key))
        try:
            header = decode(frames[2].buffer, self._accept)
        except ProtocolError as exc:
            self._count_rejected(exc.reason, exc.detail)
            self._send(sock, client, Reply(error_header(0, exc.reason, exc.detail)))
            return
        if header.kind not in self._routes:  # an ``error`` sent as a request
            self._reply_error(sock, client, header, "unexpected_kind", f"{header.kind!r} is not a request")
            return
        route = self._routes[header.kind]
        request = Request(header, (), client, identity, key=key)
        try:
            request.payload = group(frames[3:], route.kind.payload)
            self._check(route, request)
            if self._heard is not None and (request.identity is not None or header.get("from") is not None):
                self._heard(request.sender)
            # whose budget: a member's (its key's or its checked `from`), a newcomer's key, or the connection's
            budget = identity or (key and KEY_IDENTITY + key) or header.get("from") or client
            request.may_send_payload = not route.bulk or self._within_budget(budget)
            reply = route.handler(request)
            if reply.payload and not request.may_send_payload:
                if reply.hold is not None:
                    reply.hold.release()
                raise refused("busy", f"{self._max_unsent_per_client} replies to you are still unsent")
        except Refused as exc:
            self.counters.add("requests_refused")
            self.counters.add(f"refused.{exc.reason}")
            self._send(sock, client, Reply(error_header(header.id, exc.reason, exc.detail)))
            return
        except ProtocolError as exc:
            self._reply_error(sock, client, header, exc.reason, exc.detail, sender=request.sender)
            return
        except EncodeError as exc:  # our own reply broke its schema: our bug, not the requester's
            self.counters.add("replies_unencodable")
            self._log(40, ("encode", header.kind), "%s: cannot answer a %r request: %s", self.name, header.kind, exc)
            self._send(sock, client, Reply(error_header(header.id, "internal", "the reply could not be encoded")))
            return
        except Exception as exc:
            logger.exception("%s: handler for %r failed", self.name, header.kind)
            self._reply_error(sock, client, header, "internal", type(exc).__name__)
            return
        self.counters.add("requests_served")
        self.counters.add(f"served.{header.kind}")
        self._send(sock, client, reply, key=budget)

    def _check(self, route: Route, request: Request) -> None:
        size = sum(len(p) for p in request.payload)
        if size > route.max_payload_bytes:
            raise ProtocolError("too_large", f"{size} payload bytes, at most {route.max_payload_bytes}")
        if request.identity is None and request.key is not None and not route.newcomers:
            raise ProtocolError(
                "bad_identity", f"key {request.key} is no member's; a newcomer announces itself first (members)"
            )
        claimed = request.header.get("from")
        if claimed is None:
            return
        if request.identity is not None and claimed != request.identity:
            raise ProtocolError(
                "bad_identity", f"the request says it is from {claimed!r}, but its key is {request.identity!r}'s"
            )
        if request.identity is None and self._senders is not None and claimed not in self._senders:
            raise ProtocolError("bad_identity", f"{claimed!r} is not a node of this cluster")

    def _within_budget(self, key: Any) -> bool:
        """May a reply with a payload go to the sender `key` now? (Its unsent ones, and everyone's, are few.)"""
        return self._unsent.count(key) < self._max_unsent_per_client and self._unsent.total() < self._max_unsent

    def _reply_error(
        self, sock: zmq.Socket, client: bytes, header: Header, reason: str, detail: str, sender: str = "?"
    ) -> None:
        self._count_rejected(reason, detail, sender)
        self._send(sock, client, Reply(error_header(header.id, reason, detail)))

    def _count_rejected(self, reason: str, detail: str = "", sender: str = "?") -> None:
        self.counters.add("requests_rejected")
        self.counters.add(f"rejected.{reason}")
        if detail:
            self._log(
                30, ("reject", reason), "%s: rejected a request from %s: %s: %s", self.name, sender, reason, detail
            )

    def _send(self, sock: zmq.Socket, client: bytes, reply: Reply, key: Any = None) -> None:
        parts: list[Any] = [client, b"", reply.header, *reply.payload]
        tracked = bool(reply.payload)
        try:
            try:
                tracker = send_frames(sock, parts, flags=zmq.NOBLOCK, track=tracked, head=3)
            except zmq.Again:
                # libzmq learns late that its I/O thread drained the queue: reading EVENTS makes it catch
                # up on that news, and one more try tells a really full queue from a stale count.
                sock.getsockopt(zmq.EVENTS)
                tracker = send_frames(sock, parts, flags=zmq.NOBLOCK, track=tracked, head=3)
        except zmq.ZMQError as exc:  # EAGAIN: that client's queue is full; EHOSTUNREACH: it is gone
            self.counters.add("replies_dropped")
            self._log(30, ("drop", exc.errno), "%s: dropped a reply: %s", self.name, exc)
            if reply.hold is not None:
                reply.hold.release()
            return
        if tracker is not None:
            self.counters.add("bytes_out", sum(memoryview(p).nbytes for p in reply.payload))
            self._unsent.add(key if key is not None else client, tracker)
            if reply.hold is not None:
                reply.hold.release_when(tracker)
        elif reply.hold is not None:
            reply.hold.release()
