"""Relays, with sockets: a member nobody can dial is reached at a port of a member that can be dialled.

:class:`RelayServer` runs on a member that can be dialled (config ``relay_port``). :class:`RelayClient` runs
on a member that cannot (``reachable: false``): it keeps one outbound control connection to a relay, and for
every peer that connects to the port the relay granted it, dials the relay once more and splices that
connection to its own server. The protocol and its rules (messages, proofs, ports, rates) are
:mod:`dpwa.wire.relaying`'s; this module owns the sockets and the one thread each side runs.

The relay moves bytes it cannot read: peers' ZeroMQ sessions, CURVE included, run end to end between the peer
and the relayed member. It can drop, delay or cut them; a changed byte fails CURVE's authentication and the
session is dropped, and ZeroMQ connects again.

What a relay spends is bounded: at most ``len(ports)`` members, ``streams_max`` connections relayed at once
per member (more are closed at once, counted ``relay.refused.streams``), each member's streams together at
most ``rate_bytes_s`` (both directions), :data:`PIPE_BUFFER` bytes buffered per direction of a stream, and
:data:`PENDING_MAX` connections that have not yet said what they are (the oldest is dropped). A connection
that says nothing for :data:`HELLO_TIMEOUT_S`, a peer's connection the member does not pick up within
:data:`PAIR_TIMEOUT_S`, and a control connection silent for ``SILENT_S`` are closed.
"""

from __future__ import annotations

import errno
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backoff import Backoff
from ..logs import RateLimitedLog, logger
from ..stats import Counters
from .errors import ProtocolError
from .relaying import CHALLENGE_BYTES, PING_S, SILENT_S, TOKEN_BYTES, Hello, Ports, Reader, TokenBucket, encode, proof
from .sockets import POLL_SLICE_S

__all__ = ["HELLO_TIMEOUT_S", "PAIR_TIMEOUT_S", "Admit", "Local", "RelayAddress", "RelayClient", "RelayServer"]

HELLO_TIMEOUT_S = 2.0  # a new connection says what it is (hello or data) this soon
PAIR_TIMEOUT_S = 3.0  # a peer's connection waits this long for the relayed member to pick it up
PENDING_MAX = 64  # connections not yet known (at the relay's port) or not yet picked up (at a member's)
PIPE_BUFFER = 256 << 10  # bytes buffered per direction of a relayed stream
CLIENT_STREAMS_MAX = 256  # streams a relayed member splices at once (each is a peer's connection)
CONNECT_TIMEOUT_S = 2.0
BACKOFF_FIRST_S, BACKOFF_CAP_S = 0.2, 5.0  # a relayed member asks its relays again after this, doubling
TRANSIENT = ("registered", "full", "port")  # refusals that may pass (the others: the cluster's consent, a proof)

# (hello, the challenge it answers) -> None to admit, or why not
Admit = Callable[[Hello, bytes], "str | None"]


@dataclass(frozen=True)
class RelayAddress:
    """A relay as a relayed member's config lists it."""

    host: str
    port: int
    public_key: bytes | None = None  # its raw 32-byte CURVE key (a cluster with keys)


@dataclass(frozen=True)
class Local:
    """Where the relayed member's own server listens: a TCP address, or an ipc socket's path."""

    host: str = ""
    port: int = 0
    path: str = ""

    def connect(self) -> socket.socket:
        if self.path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = self.path
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
            target = (self.host, self.port)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(target)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        return sock


class _Pipe:
    """Two connections spliced: what one sends the other receives, through a bounded buffer each way."""

    def __init__(self, a: socket.socket, b: socket.socket, bucket: TokenBucket | None, to_a: bytes = b"") -> None:
        self.socks = (a, b)
        self.out: tuple[bytearray, bytearray] = (bytearray(to_a), bytearray())  # to be written to a, to b
        self.bucket = bucket
        self.closed = False
        self.moved = 0
        self._masks = [0, 0]

    def arm(self, selector: selectors.BaseSelector, now: float) -> None:
        """(Re)register both sockets for what they can do now: read while the other way has room (and the rate
        allows), write while something waits."""
        allowed = self.bucket is None or self.bucket.allowance(now) > 0
        for side in (0, 1):
            mask = 0
            if allowed and len(self.out[1 - side]) < PIPE_BUFFER:
                mask |= selectors.EVENT_READ
            if self.out[side]:
                mask |= selectors.EVENT_WRITE
            if mask == self._masks[side]:
                continue
            sock = self.socks[side]
            if self._masks[side] == 0:
                selector.register(sock, mask, (self, side))
            elif mask == 0:
                selector.unregister(sock)
            else:
                selector.modify(sock, mask, (self, side))
            self._masks[side] = mask

    def throttled(self, now: float) -> bool:
        return self.bucket is not None and self.bucket.allowance(now) <= 0

    def ready(self, side: int, mask: int, now: float) -> None:
        """Move what `side` can move; close both on EOF or an error."""
        try:
            if mask & selectors.EVENT_READ:
                room = PIPE_BUFFER - len(self.out[1 - side])
                if self.bucket is not None:
                    room = min(room, self.bucket.allowance(now))
                if room > 0:
                    data = self.socks[side].recv(room)
                    if not data:  # what is still buffered for the other side goes, as far as it goes at once
                        if self.out[1 - side]:
                            self.socks[1 - side].send(self.out[1 - side])
                        raise ConnectionResetError("closed")
                    self.out[1 - side].extend(data)
                    self.moved += len(data)
                    if self.bucket is not None:
                        self.bucket.spend(len(data), now)
            other = 1 - side
            for target in (side, other):
                if self.out[target]:
                    sent = self.socks[target].send(self.out[target])
                    del self.out[target][:sent]
        except BlockingIOError:
            pass
        except OSError:
            self.closed = True

    def close(self, selector: selectors.BaseSelector) -> None:
        self.closed = True
        for side, sock in enumerate(self.socks):
            if self._masks[side]:
                selector.unregister(sock)
                self._masks[side] = 0
            sock.close()


def _send_now(sock: socket.socket, data: bytes) -> bool:
    """Send a small message on a non-blocking socket, whole or not at all (False: drop the connection)."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


@dataclass
class _New:
    sock: socket.socket
    deadline: float
    challenge: bytes
    reader: Reader = field(default_factory=Reader)


@dataclass
class _Member:
    hello: Hello
    sock: socket.socket  # the control connection
    listener: socket.socket  # its port
    port: int
    bucket: TokenBucket
    heard: float
    pinged: float
    reader: Reader = field(default_factory=Reader)
    streams: int = 0


@dataclass
class _Waiting:
    sock: socket.socket  # a peer's connection at the member's port
    member: str
    deadline: float


class RelayServer:
    """Relays for members nobody can dial, from one thread that owns every socket it opens.

    Args:
        host: the address to listen on (the relay port and the members' ports).
        port: where members register.
        ports: the ports members get, one each (so ``len(ports)`` members at most).
        streams_max: connections relayed at once for one member.
        rate_bytes_s: what one member's streams move together, a second (0: no bound).
        admit: decides each registration (None: everyone; a cluster with keys checks certificates and proofs).
        counters: ``relay.*`` counters and gauges go here.
    """

    def __init__(
        self,
        host: str,
        port: int,
        ports: range,
        *,
        name: str = "dpwa",
        streams_max: int = 32,
        rate_bytes_s: float = 0.0,
        admit: Admit | None = None,
        counters: Counters | None = None,
    ) -> None:
        self.host, self.port, self.name = host, port, name
        self._ports = Ports(ports)
        self._streams_max, self._rate = streams_max, rate_bytes_s
        self._admit = admit
        self.counters = counters or Counters()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"dpwa-relay-{name}", daemon=True)
        self._log = RateLimitedLog()

    def start(self, timeout_s: float = 5.0) -> RelayServer:
        """Listen (OSError if the port cannot be bound) and serve from now on."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self._stop.set()
            raise TimeoutError(f"{self.name}: the relay did not start within {timeout_s} s")
        if self._error is not None:
            self._thread.join(timeout_s)
            raise self._error
        return self

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop relaying; every connection is closed. True if the thread stopped within `timeout_s`."""
        return _stopped(self._stop, self._thread, timeout_s)

    # ----------------------------------------------------------------- the relay's thread

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            listener = _listen(self.host, self.port)
        except OSError as exc:
            self._error = OSError(
                exc.errno, f"{self.name}: cannot listen for relayed members on {self.host}:{self.port}: {exc.strerror}"
            )
            self._ready.set()
            selector.close()
            return
        selector.register(listener, selectors.EVENT_READ, "listener")
        self._new: OrderedDict[socket.socket, _New] = OrderedDict()
        self._members: dict[str, _Member] = {}
        self._waiting: dict[bytes, _Waiting] = {}
        self._pipes: list[tuple[_Pipe, str]] = []
        self._ready.set()
        logger.info("%s: relaying for members nobody can dial, at %s:%d", self.name, self.host, self.port)
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = POLL_SLICE_S
                for pipe, _ in self._pipes:
                    if pipe.bucket is not None and pipe.throttled(now):
                        wait = min(wait, max(0.001, pipe.bucket.wait_s(now)))
                for key, mask in selector.select(wait):
                    now = time.monotonic()
                    self._event(selector, listener, key, mask, now)
                self._tend(selector, time.monotonic())
        finally:
            for pipe, _ in self._pipes:
                pipe.close(selector)
            for member in list(self._members.values()):
                self._drop_member(selector, member)
            for sock in [*self._new, *(w.sock for w in self._waiting.values())]:
                sock.close()
            listener.close()
            selector.close()

    def _event(
        self,
        selector: selectors.BaseSelector,
        listener: socket.socket,
        key: selectors.SelectorKey,
        mask: int,
        now: float,
    ) -> None:
        data = key.data
        if data == "listener":
            self._accept_new(selector, listener, now)
        elif isinstance(data, tuple) and isinstance(data[0], _Pipe):
            pipe, side = data
            pipe.ready(side, mask, now)
        elif isinstance(data, _New):
            self._read_new(selector, data, now)
        elif isinstance(data, _Member):
            self._read_control(selector, data, now)
        elif isinstance(data, tuple) and data[0] == "port":
            self._accept_peer(selector, self._members.get(data[1]), now)

    def _accept_new(self, selector: selectors.BaseSelector, listener: socket.socket, now: float) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        if len(self._new) >= PENDING_MAX:  # the oldest stranger goes
            old, conn = self._new.popitem(last=False)
            selector.unregister(old)
            old.close()
            self.counters.add("relay.refused.pending")
        conn = _New(sock, now + HELLO_TIMEOUT_S, secrets.token_bytes(CHALLENGE_BYTES))
        if not _send_now(sock, encode("challenge", c=conn.challenge)):
            sock.close()
            return
        self._new[sock] = conn
        selector.register(sock, selectors.EVENT_READ, conn)

    def _read_new(self, selector: selectors.BaseSelector, conn: _New, now: float) -> None:
        try:
            data = conn.sock.recv(4096)
            if not data:
                raise ConnectionResetError("closed")
            msg = next(conn.reader.feed(data), None)
        except (OSError, ProtocolError) as exc:
            if isinstance(exc, ProtocolError):
                self.counters.add(f"relay.refused.{exc.reason}")
            self._forget_new(selector, conn)
            conn.sock.close()
            return
        if msg is None:
            return
        self._forget_new(selector, conn)
        if msg["t"] == "hello":
            self._register(selector, conn, Hello.of(msg), now)
        elif msg["t"] == "data":
            self._pair(selector, conn, msg["token"], now)
        else:
            self.counters.add("relay.refused.bad_kind")
            conn.sock.close()

    def _forget_new(self, selector: selectors.BaseSelector, conn: _New) -> None:
        if self._new.pop(conn.sock, None) is not None:
            selector.unregister(conn.sock)

    def _register(self, selector: selectors.BaseSelector, conn: _New, hello: Hello, now: float) -> None:
        why = self._admit(hello, conn.challenge) if self._admit is not None else None
        port = None
        if why is None and hello.name in self._members:
            why = "registered"  # its earlier control connection is still open (it ends within SILENT_S)
        if why is None:
            port = self._ports.grant(hello.name, hello.want)
            why = "full" if port is None else None
        listener = None
        if port is not None:
            try:
                listener = _listen(self.host, port)
            except OSError as exc:
                self._ports.release(hello.name)
                why = f"port {port}: {exc.strerror}"
        if why is not None or listener is None or port is None:
            self.counters.add(f"relay.refused.{why.split(':')[0].replace(' ', '_') if why else 'port'}")
            self._log(30, ("refused", hello.name), "%s: relay refused %s: %s", self.name, hello.name, why)
            _send_now(conn.sock, encode("no", why=why or "port"))
            conn.sock.close()
            return
        if not _send_now(conn.sock, encode("ok", port=port)):
            self._ports.release(hello.name)
            listener.close()
            conn.sock.close()
            return
        # Its streams from before a reconnect go on: they count against streams_max and share its rate.
        live = [pipe for pipe, name in self._pipes if name == hello.name]
        bucket = next((p.bucket for p in live if p.bucket is not None), None)
        bucket = bucket or TokenBucket(self._rate, max(self._rate / 10, PIPE_BUFFER), now)
        member = _Member(
            hello, conn.sock, listener, port, bucket, heard=now, pinged=now, reader=conn.reader, streams=len(live)
        )
        self._members[hello.name] = member
        selector.register(conn.sock, selectors.EVENT_READ, member)
        selector.register(listener, selectors.EVENT_READ, ("port", hello.name))
        self.counters.add("relay.registered")
        self.counters.set("relay.members", len(self._members))
        logger.info("%s: relaying for %s at port %d", self.name, hello.name, port)

    def _read_control(self, selector: selectors.BaseSelector, member: _Member, now: float) -> None:
        try:
            data = member.sock.recv(4096)
            if not data:
                raise ConnectionResetError("closed")
            for msg in member.reader.feed(data):
                if msg["t"] != "ping":
                    raise ProtocolError("bad_kind", f"{msg['t']} on a control connection")
            member.heard = now
        except (OSError, ProtocolError) as exc:
            logger.info("%s: %s's relay connection closed (%s)", self.name, member.hello.name, exc)
            self._drop_member(selector, member)

    def _accept_peer(self, selector: selectors.BaseSelector, member: _Member | None, now: float) -> None:
        if member is None:
            return
        try:
            sock, _ = member.listener.accept()
        except OSError:
            return
        if (
            member.streams + sum(w.member == member.hello.name for w in self._waiting.values()) >= self._streams_max
            or len(self._waiting) >= PENDING_MAX
        ):
            self.counters.add("relay.refused.streams")
            self._log(
                30,
                ("streams", member.hello.name),
                "%s: relay for %s is at its %d streams",
                self.name,
                member.hello.name,
                self._streams_max,
            )
            sock.close()
            return
        sock.setblocking(False)
        token = secrets.token_bytes(TOKEN_BYTES)
        if not _send_now(member.sock, encode("open", token=token)):
            sock.close()
            self._drop_member(selector, member)
            return
        self._waiting[token] = _Waiting(sock, member.hello.name, now + PAIR_TIMEOUT_S)

    def _pair(self, selector: selectors.BaseSelector, conn: _New, token: bytes, now: float) -> None:
        waiting = self._waiting.pop(token, None)
        member = self._members.get(waiting.member) if waiting is not None else None
        if waiting is None or member is None:
            self.counters.add("relay.refused.token")
            conn.sock.close()
            if waiting is not None:
                waiting.sock.close()
            return
        pipe = _Pipe(waiting.sock, conn.sock, member.bucket if self._rate > 0 else None, to_a=conn.reader.leftover())
        member.streams += 1
        self._pipes.append((pipe, member.hello.name))
        pipe.arm(selector, now)
        self.counters.add("relay.streams_opened")

    def _drop_member(self, selector: selectors.BaseSelector, member: _Member) -> None:
        name = member.hello.name
        current = self._members.get(name) is member  # not a stale event of a member that registered again since
        if current:
            del self._members[name]
            self._ports.release(name)
        for sock in (member.sock, member.listener):
            try:
                selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        for token in [t for t, w in self._waiting.items() if w.member == name and current]:
            self._waiting.pop(token).sock.close()
        self.counters.set("relay.members", len(self._members))

    def _tend(self, selector: selectors.BaseSelector, now: float) -> None:
        """Expire the silent and the unclaimed, ping the members, and re-arm the pipes."""
        for conn in [c for c in self._new.values() if now > c.deadline]:
            self._forget_new(selector, conn)
            conn.sock.close()
            self.counters.add("relay.refused.silent")
        for token in [t for t, w in self._waiting.items() if now > w.deadline]:
            self._waiting.pop(token).sock.close()
            self.counters.add("relay.refused.unclaimed")
        for member in list(self._members.values()):
            if now - member.heard > SILENT_S:
                logger.info("%s: %s's relay connection went silent", self.name, member.hello.name)
                self._drop_member(selector, member)
            elif now - member.pinged >= PING_S:
                member.pinged = now
                if not _send_now(member.sock, encode("ping")):
                    self._drop_member(selector, member)
        alive = []
        for pipe, name in self._pipes:
            if pipe.closed:
                pipe.close(selector)
                self.counters.add("relay.bytes", pipe.moved)
                owner = self._members.get(name)
                if owner is not None:
                    owner.streams -= 1
            else:
                pipe.arm(selector, now)
                alive.append((pipe, name))
        self._pipes = alive
        self.counters.set("relay.streams", len(alive))


def _stopped(stop: threading.Event, thread: threading.Thread, timeout_s: float) -> bool:
    """Tell `thread` to stop and wait for it at most `timeout_s`: True if it did."""
    stop.set()
    if thread.is_alive():
        thread.join(timeout_s)
    return not thread.is_alive()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(64)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class RelayClient:
    """A member that nobody can dial, reached through a relay: one thread that owns its control connection
    and every stream it splices to its own server. Picking up a peer's connection dials the relay (within
    CONNECT_TIMEOUT_S), meanwhile the member's other relayed streams wait.

    Args:
        name: this member.
        relays: the relays it may register at, asked in order until one grants a port; after that, only that one
            (its port is this member's address in every view) is asked again when the connection is lost.
        local: this member's own server.
        secret: (a cluster with keys) this member's raw 32-byte CURVE secret key, its Z85 public key and its
            certificate, for the relay's checks.
    """

    def __init__(
        self,
        name: str,
        relays: Sequence[RelayAddress],
        local: Local,
        *,
        secret: tuple[bytes, str, str] | None = None,
        counters: Counters | None = None,
    ) -> None:
        if not relays:
            raise ValueError(f"{name}: a member nobody can dial needs at least one relay")
        self.name, self._relays, self._local, self._secret = name, list(relays), local, secret
        self.counters = counters or Counters()
        self.granted: tuple[str, int] | None = None  # (relay host, port): where peers reach this member
        self.refusals: list[str] = []  # the last round's refusals, for the error at start
        self._granted = threading.Event()
        self._refused_for_good: set[RelayAddress] = set()  # relays that refused this member's consent or proof
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dpwa-relayed-{name}", daemon=True)

    def start(self) -> RelayClient:
        self._thread.start()
        return self

    def wait_granted(self, timeout_s: float) -> tuple[str, int] | None:
        """Where peers reach this member once a relay has granted it a port; None if none did within `timeout_s`,
        or sooner once every relay refused it for good (its certificate, its proof: asking again will not help)."""
        deadline = time.monotonic() + timeout_s
        while not self._granted.wait(min(POLL_SLICE_S, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline or len(self._refused_for_good) == len(self._relays):
                break
        return self.granted

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop; the control connection and every stream are closed. True if the thread stopped within `timeout_s`."""
        return _stopped(self._stop, self._thread, timeout_s)

    # ----------------------------------------------------------------- the member's thread

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        pipes: list[_Pipe] = []
        control: socket.socket | None = None
        reader = Reader()
        backoff, next_try, index = Backoff(BACKOFF_FIRST_S, BACKOFF_CAP_S), 0.0, 0
        heard = pinged = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if control is None and now >= next_try:
                    relay = self._relays[index]
                    control, reader = self._register(relay)
                    if control is None:
                        if self.granted is None:  # not yet anywhere: the next relay
                            index = (index + 1) % len(self._relays)
                        next_try = backoff.fail(now)
                    else:
                        backoff.reset()
                        heard = pinged = time.monotonic()
                        selector.register(control, selectors.EVENT_READ, "control")
                for key, mask in selector.select(POLL_SLICE_S):
                    now = time.monotonic()
                    if key.data == "control":
                        assert control is not None
                        opened, alive = self._read_control(control, reader)
                        if alive:
                            heard = now
                        for token in opened:
                            pipe = self._open(self._relays[index], token) if len(pipes) < CLIENT_STREAMS_MAX else None
                            if pipe is not None:
                                pipes.append(pipe)
                                pipe.arm(selector, now)
                        if not alive:
                            selector.unregister(control)
                            control.close()
                            control = None
                            next_try = now + backoff.peek()  # the wait a failure to register would bring
                    else:
                        pipe, side = key.data
                        pipe.ready(side, mask, now)
                now = time.monotonic()
                if control is not None and (
                    now - heard > SILENT_S or (now - pinged >= PING_S and not _send_now(control, encode("ping")))
                ):
                    self.counters.add("relay.lost")
                    selector.unregister(control)
                    control.close()
                    control, next_try = None, now + backoff.peek()
                elif control is not None and now - pinged >= PING_S:
                    pinged = now
                kept = []
                for pipe in pipes:
                    if pipe.closed:
                        pipe.close(selector)
                    else:
                        pipe.arm(selector, now)
                        kept.append(pipe)
                pipes = kept
                self.counters.set("relay.streams", len(pipes))
        finally:
            for pipe in pipes:
                pipe.close(selector)
            if control is not None:
                control.close()
            selector.close()

    def _register(self, relay: RelayAddress) -> tuple[socket.socket | None, Reader]:
        """A control connection at `relay` that was granted a port, or None (the reason in refusals)."""
        reader = Reader()
        try:
            sock = socket.create_connection((relay.host, relay.port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            self._refused(relay, f"cannot connect: {exc.strerror or exc}")
            return None, reader
        try:
            sock.settimeout(HELLO_TIMEOUT_S)
            challenge = _read_one(sock, reader)
            if challenge.get("t") != "challenge":
                raise ProtocolError("bad_kind", f"expected a challenge, got {challenge.get('t')}")
            want = self.granted[1] if self.granted is not None else 0
            fields: dict[str, Any] = {"name": self.name, "want": want}
            if self._secret is not None:
                if relay.public_key is None:
                    raise ProtocolError("no_key", "the relay's public_key is not in the config")
                secret, public, cert = self._secret
                fields.update(key=public, cert=cert, proof=proof(secret, relay.public_key, challenge["c"], self.name))
            sock.sendall(encode("hello", **fields))
            answer = _read_one(sock, reader)
            if answer["t"] != "ok":
                why = str(answer.get("why", answer["t"]))
                if not why.startswith(TRANSIENT):
                    self._refused_for_good.add(relay)
                raise ProtocolError("refused", why)
            port = int(answer["port"])
            if self.granted is not None and self.granted != (relay.host, port):
                logger.error(
                    "%s: the relay gave port %d, not %d: peers that know the old address cannot reach this node",
                    self.name,
                    port,
                    self.granted[1],
                )
                self.counters.add("relay.moved")
            if self.granted is None:
                self.granted = (relay.host, port)
                logger.info("%s: reachable through the relay %s:%d at port %d", self.name, relay.host, relay.port, port)
            self._granted.set()
            self.refusals.clear()
            self.counters.add("relay.registered")
            sock.setblocking(False)
            return sock, reader
        except (OSError, ProtocolError) as exc:
            sock.close()
            self._refused(relay, str(exc))
            return None, reader

    def _refused(self, relay: RelayAddress, why: str) -> None:
        self.counters.add("relay.refused")
        self.refusals = [*self.refusals[-7:], f"{relay.host}:{relay.port}: {why}"]
        logger.info("%s: relay %s:%d: %s", self.name, relay.host, relay.port, why)

    def _read_control(self, control: socket.socket, reader: Reader) -> tuple[list[bytes], bool]:
        """The tokens of peers' connections the relay holds for us, and whether the connection lives."""
        try:
            data = control.recv(4096)
            if not data:
                return [], False
            opened = []
            for msg in reader.feed(data):
                if msg["t"] == "open":
                    opened.append(msg["token"])
                elif msg["t"] != "ping":
                    raise ProtocolError("bad_kind", f"{msg['t']} on a control connection")
            return opened, True
        except BlockingIOError:
            return [], True
        except (OSError, ProtocolError) as exc:
            logger.info("%s: relay connection closed: %s", self.name, exc)
            return [], False

    def _open(self, relay: RelayAddress, token: bytes) -> _Pipe | None:
        """Pick up a peer's connection: dial the relay with its token and splice it to our own server."""
        try:
            remote = socket.create_connection((relay.host, relay.port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            self.counters.add("relay.open_failed")
            return None
        try:
            remote.settimeout(HELLO_TIMEOUT_S)
            reader = Reader()
            _read_one(remote, reader)  # the relay's challenge: a data connection needs none
            remote.sendall(encode("data", token=token))
            remote.setblocking(False)
            local = self._local.connect()
        except (OSError, ProtocolError):
            remote.close()
            self.counters.add("relay.open_failed")
            return None
        self.counters.add("relay.streams_opened")
        return _Pipe(local, remote, None, to_a=reader.leftover())


def _read_one(sock: socket.socket, reader: Reader) -> dict[str, Any]:
    """One message from a blocking socket (with its timeout)."""
    while True:
        data = sock.recv(4096)
        if not data:
            raise ConnectionResetError(errno.ECONNRESET, "closed by the relay")
        for msg in reader.feed(data):
            return msg
