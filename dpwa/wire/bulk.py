"""A data path beside the control messages: large payloads as raw TCP streams, plain or sealed per transfer.

ZeroMQ moves a 44.7 MB snapshot over loopback in about 1.4 times the time
of a raw TCP stream of the same bytes (and about 4 times under CURVE), and
then the receiver still copies and checks it. A raw stream can land the
bytes straight in the buffer they are blended from, and the receiver can
check each block as it arrives, while the next is on the wire. So a
requester may ask for a large snapshot by stream:

1. its request (over ZeroMQ) says ``bulk``; the server answers, over
   ZeroMQ, with the snapshot's header, the port of its :class:`BulkServer`,
   a fresh 16-byte token and, in a cluster with CURVE keys, a fresh 256-bit
   AES key (:class:`Ticket`), and hands the leased snapshot to the bulk
   server;
2. the requester (:class:`BulkReceiver`) connects to that port (or reuses
   its connection), sends the token, and reads exactly the announced number
   of bytes into its own buffer.

**Sealed streams** (``sealed=True``, for clusters with CURVE keys): the
snapshot goes in blocks of :data:`BLOCK_BYTES`, each encrypted and
authenticated with AES-256 in OCB3 mode (RFC 7253; :data:`Cipher`) under
the transfer's own key, which only ever travelled inside the CURVE-encrypted
reply. Block ``k`` is sealed with the nonce ``k`` (never reused: a key
serves one transfer) and associated data that bind the token, ``k``, the
total size and whether it is the last block (:func:`associated_data`). A block that was forged, flipped, replayed
(from this transfer or another), reordered or cut fails authentication, and
a stream that ends early fails its length: either way the transfer fails
(:class:`BulkError`), and no byte of a block is used before that block is
authenticated. The receiver decrypts block ``k`` into the buffer it blends
from while block ``k + 1`` is on the wire; the server seals the next block
while the socket drains (see :meth:`BulkServer._write_sealed`).

A token is unguessable, serves once, and expires with the request's
deadline (plus a second), releasing the snapshot. Nobody else is trusted
either: a connection that does not send a known token within
:data:`HELLO_TIMEOUT_S` is closed, as is one that stops reading (its
transfer expires). Accepting is fair: at ``max_connections``, a newcomer
evicts the oldest connection that never presented a valid token (a
*stranger*) instead of being refused, and a connection that did (it belongs
to that token's sender) is never evicted by strangers; a sender owns at most
``max_per_sender`` connections. An evicted stranger is reset, and a
requester reset before its token was read connects again (at most
:data:`EVICTED_ATTEMPTS` connections). So a flood of silent connections
delays a peer's stream by a few round trips, and cannot stop it. Each sender name
has at most ``max_per_sender`` transfers offered and unclaimed. Only the
requester that got the token (and key) over the authenticated ZeroMQ
channel can claim the transfer, and under CURVE only it can read it.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESOCB3

from ..logs import RateLimitedLog, logger
from ..stats import Counters
from .errors import ProtocolError, RequestCancelled, RequestTimeout, TransportError, refused
from .payload import Hold
from .sockets import POLL_SLICE_S

__all__ = [
    "BLOCK_BYTES",
    "HELLO_TIMEOUT_S",
    "KEY_BYTES",
    "TAG_BYTES",
    "TOKEN_BYTES",
    "BulkError",
    "BulkReceiver",
    "BulkServer",
    "Ticket",
    "Cipher",
    "associated_data",
    "block_count",
    "nonce",
    "sealed_bytes",
]

TOKEN_BYTES = 16
KEY_BYTES = 32  # AES-256
TAG_BYTES = 16  # the AEAD's authentication tag: a sealed block is its plaintext and this
HELLO_TIMEOUT_S = 2.0  # a new connection must send its whole token this soon (a reused one: its next token)
IDLE_TIMEOUT_S = 60.0  # a connection that served a transfer and waits for the next is closed after this
BLOCK_BYTES = 1 << 20  # the receiver checks (and the server sends, or seals) this much at a time
# Connections accepted per turn of the bulk thread, after the turn has read the tokens that came in. Small,
# so that a connection waits in the kernel's queue (where its token arrives) rather than among strangers
# that newcomers evict: a requester's token is almost always in when it is accepted.
ACCEPT_BATCH = 2
_CONTEXT = b"dpwa-bulk-1"  # the first bytes of every block's associated data: this protocol, this version
# The AEAD of sealed streams. OCB3 and GCM both run on AES-NI; OCB3 needs no carry-less multiplication
# pass, and seals or opens a 1 MiB block in 0.6 times GCM's time on this project's machines (docs/performance.md).
# Both ends must use the same: changing it changes the protocol (and _CONTEXT).
Cipher = AESOCB3


class BulkError(TransportError):
    """The stream failed: no connection, closed early, stalled, token refused, or a block that failed
    authentication. Nothing of it may be used; the snapshot may be asked for again over ZeroMQ."""


class Ticket(NamedTuple):
    """What the requester needs to claim a transfer: sent to it over the authenticated ZeroMQ channel."""

    token: bytes  # claims the transfer, once
    key: bytes | None  # the transfer's AES-256 key (a sealed stream), else None (a plain one)


def block_count(total: int) -> int:
    """Blocks of a `total`-byte transfer (the last one may be shorter)."""
    return -(-total // BLOCK_BYTES)


def sealed_bytes(total: int) -> int:
    """Bytes on the wire of a sealed `total`-byte transfer: each block carries a tag."""
    return total + TAG_BYTES * block_count(total)


def nonce(index: int) -> bytes:
    """Block `index`'s 96-bit nonce; unique under a key, because a key seals one transfer only."""
    return index.to_bytes(12, "big")


def associated_data(token: bytes, index: int, total: int) -> bytes:
    """What block `index` is authenticated together with: the protocol, the transfer (its token), the
    block's place, the transfer's size and whether the block is the last one. A block moved to another
    place, transfer or stream length fails authentication."""
    final = b"\x01" if index == block_count(total) - 1 else b"\x00"
    return b"".join((_CONTEXT, token, index.to_bytes(8, "big"), total.to_bytes(8, "big"), final))


@dataclass(eq=False)
class _Transfer:
    token: bytes
    sender: str
    views: list[memoryview]
    hold: Hold | None
    expires: float
    total: int
    cipher: Cipher | None = None  # sealed: the transfer's own key


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    opened: float = field(default_factory=time.monotonic)
    hello: bytearray = field(default_factory=bytearray)
    idle_since: float = field(default_factory=time.monotonic)
    owner: str | None = None  # the sender whose valid token it presented; None: a stranger
    transfer: _Transfer | None = None
    part: int = 0  # plain: the view being sent, and how far
    offset: int = 0
    block: int = 0  # sealed: the next block to seal
    # sealed blocks ready (their buffer, and the view of it to send), oldest first; at most 2
    out: deque[tuple[bytearray, memoryview]] = field(default_factory=deque)
    out_sent: int = 0  # bytes of out[0] sent
    spare: list[bytearray] = field(default_factory=list)  # sealing buffers not in `out`
    served: int = 0  # transfers completed on this connection


class BulkServer:
    """Streams leased snapshots to requesters holding a token, from one thread that owns every socket.

    Args:
        host: the address to listen on (the node's resolved bind address); the port is picked free.
        sealed: encrypt and authenticate every transfer with a key of its own (clusters with CURVE keys).
        name: for logs and the thread's name.
        counters: where to count transfers.
        max_per_sender: transfers offered and unclaimed, and connections owned, per sender name.
        max_pending: transfers offered and unclaimed in all.
        max_connections: open connections at most; past it a newcomer evicts the oldest stranger,
            or is closed at once when every connection belongs to a sender.
    """

    def __init__(
        self,
        host: str,
        *,
        sealed: bool = False,
        name: str = "dpwa",
        counters: Counters | None = None,
        max_per_sender: int = 3,
        max_pending: int = 12,
        max_connections: int = 32,
    ) -> None:
        self.name = name
        self.sealed = sealed
        self.counters = counters or Counters()
        self._max_per_sender, self._max_pending, self._max_connections = max_per_sender, max_pending, max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(("" if host in ("*", "0.0.0.0") else host.strip("[]"), 0))
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError as exc:
            self._listener.close()
            raise TransportError(f"{name}: cannot listen for bulk transfers on {host}: {exc}") from exc
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._transfers: dict[bytes, _Transfer] = {}  # offered, not yet claimed
        self._stop = threading.Event()
        self._log = RateLimitedLog()
        self._scratch = bytearray()  # a sealed block that spans two buffers is gathered here (bulk thread)
        self._thread = threading.Thread(target=self._run, name=f"dpwa-bulk-{name}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- any thread (the Rx thread offers)

    def offer(self, sender: str, buffers: Sequence[Any], hold: Hold | None, ttl_s: float) -> Ticket:
        """Hold `buffers` for `sender` for up to `ttl_s`; the ticket that claims them. Refused("busy") past
        the budget, Refused("closing") once closing (the caller still owns `hold` then).

        The hold is released once the bytes are sent, or when the offer expires or fails.
        """
        token = secrets.token_bytes(TOKEN_BYTES)
        key = secrets.token_bytes(KEY_BYTES) if self.sealed else None
        views = [memoryview(b).cast("B") for b in buffers]
        with self._lock:
            if self._stop.is_set():
                raise refused("closing", "this node is closing")
            self._expire(time.monotonic())
            mine = sum(1 for t in self._transfers.values() if t.sender == sender)
            if mine >= self._max_per_sender or len(self._transfers) >= self._max_pending:
                raise refused("busy", f"{mine} bulk transfers to you are still waiting")
            self._transfers[token] = _Transfer(
                token,
                sender,
                views,
                hold,
                time.monotonic() + ttl_s,
                sum(v.nbytes for v in views),
                Cipher(key) if key is not None else None,
            )
        return Ticket(token, key)

    def withdraw(self, token: bytes) -> bool:
        """Take back an offer nobody has claimed (its requester was refused, say), releasing its hold now
        instead of at its expiry: True if it was still waiting. A claimed one goes on."""
        with self._lock:
            transfer = self._transfers.pop(token, None)
        if transfer is None:
            return False
        _release(transfer)
        self.counters.add("bulk_withdrawn")
        return True

    def pending(self) -> int:
        with self._lock:
            return len(self._transfers)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread, close every connection, release every held snapshot. True if it ended in time."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("%s: bulk thread still running %.1f s after close()", self.name, timeout_s)
            return False
        with self._lock:
            for transfer in self._transfers.values():
                _release(transfer)
            self._transfers.clear()
        return True

    def _expire(self, now: float) -> None:  # with the lock held
        for token in [t for t, transfer in self._transfers.items() if now >= transfer.expires]:
            _release(self._transfers.pop(token))
            self.counters.add("bulk_expired")

    # ----------------------------------------------------------------- the thread

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        connections: dict[int, _Connection] = {}
        try:
            selector.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                accept = False
                for key, events in selector.select(POLL_SLICE_S):
                    if key.fileobj is self._listener:
                        accept = True  # after the connections' own events: a token already in is read first
                        continue
                    conn = connections.get(key.fd)
                    if conn is None or conn.sock is not key.fileobj:
                        continue  # dropped earlier in this turn
                    try:
                        if events & selectors.EVENT_READ and not self._read(selector, connections, conn):
                            self._drop(selector, connections, conn, "")  # the requester hung up between transfers
                            continue
                        if conn.transfer is not None and events & selectors.EVENT_WRITE:
                            self._write(selector, conn)
                    except (OSError, ProtocolError) as exc:
                        self._drop(selector, connections, conn, str(exc))
                if accept:
                    self._accept(selector, connections)
                self._sweep(selector, connections)
        except Exception:  # a bug here must be loud, but must not hang close()
            logger.exception("%s: bulk thread failed", self.name)
        finally:
            for conn in list(connections.values()):
                self._drop(selector, connections, conn, "")
            selector.close()
            self._listener.close()

    def _accept(self, selector: selectors.BaseSelector, connections: dict[int, _Connection]) -> None:
        fresh: list[_Connection] = []  # accepted in this turn: never evicted before their token had a turn
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, say: try again later
                self._log(30, ("accept", exc.errno), "%s: bulk: cannot accept a connection: %s", self.name, exc)
                return
            if len(connections) >= self._max_connections:
                strangers = [
                    c for c in connections.values() if c.owner is None and c.transfer is None and c not in fresh
                ]
                if not strangers:  # every connection belongs to a sender (at most max_per_sender each)
                    self.counters.add("bulk_refused_connections")
                    sock.close()
                    continue
                victim = min(strangers, key=lambda c: c.opened)
                # closed with a reset: a requester whose token was not read yet learns that it was evicted
                # (its token is still good, so it connects again), not that its transfer is gone
                victim.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self._drop(selector, connections, victim, "evicted: the oldest that sent no token", "bulk_evicted")
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = connections[sock.fileno()] = _Connection(sock)
            fresh.append(conn)
            selector.register(sock, selectors.EVENT_READ)
            try:  # a requester sends its token right after connecting: it is often here already
                if not self._read(selector, connections, conn):
                    self._drop(selector, connections, conn, "")
            except (OSError, ProtocolError) as exc:
                self._drop(selector, connections, conn, str(exc))

    def _read(self, selector: selectors.BaseSelector, connections: dict[int, _Connection], conn: _Connection) -> bool:
        """Read (part of) a token; False when the requester closed the connection between transfers."""
        try:
            data = conn.sock.recv(TOKEN_BYTES - len(conn.hello))
        except (BlockingIOError, InterruptedError):
            return True
        if not data:
            if conn.transfer is not None or conn.hello:
                raise ProtocolError("closed", "the requester closed the connection in the middle of a transfer")
            return False
        if conn.transfer is not None:
            raise ProtocolError("bad_stream", "bytes from the requester in the middle of a transfer")
        conn.hello += data
        if len(conn.hello) < TOKEN_BYTES:
            return True
        token, conn.hello = bytes(conn.hello), bytearray()
        with self._lock:
            transfer = self._transfers.pop(token, None)
        if transfer is None:
            self.counters.add("bulk_bad_tokens")
            raise ProtocolError("bad_token", "a token that names no transfer (expired, used, or never given)")
        owned = [c for c in connections.values() if c is not conn and c.owner == transfer.sender]
        if len(owned) >= self._max_per_sender:
            idle = [c for c in owned if c.transfer is None]
            if not idle:
                _release(transfer)
                raise ProtocolError(
                    "too_many_streams", f"{transfer.sender} has {len(owned)} bulk streams in progress already"
                )
            self._drop(selector, connections, min(idle, key=lambda c: c.idle_since), "")  # its oldest idle one
        conn.owner = transfer.sender
        conn.transfer, conn.part, conn.offset, conn.block = transfer, 0, 0, 0
        selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        return True

    def _write(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        transfer = conn.transfer
        assert transfer is not None
        if transfer.cipher is not None:
            self._write_sealed(selector, conn, transfer, transfer.cipher)
            return
        for _ in range(64):  # bounded, so other connections get their turn
            if conn.part == len(transfer.views):
                self._finish(selector, conn)
                return
            view = transfer.views[conn.part]
            try:
                sent = conn.sock.send(view[conn.offset : conn.offset + BLOCK_BYTES])
            except (BlockingIOError, InterruptedError):
                return
            self.counters.add("bytes_out", sent)
            conn.offset += sent
            if conn.offset == view.nbytes:
                conn.part, conn.offset = conn.part + 1, 0

    def _write_sealed(
        self, selector: selectors.BaseSelector, conn: _Connection, transfer: _Transfer, cipher: Cipher
    ) -> None:
        """Send sealed blocks; when the socket is full, seal the next block meanwhile (at most one ahead)."""
        count = block_count(transfer.total)
        for _ in range(64):  # bounded, so other connections get their turn
            if not conn.out:
                if conn.block == count:
                    self._finish(selector, conn)
                    return
                self._seal(conn, transfer, cipher)
            buffer, head = conn.out[0]
            try:
                sent = conn.sock.send(head[conn.out_sent :])
            except (BlockingIOError, InterruptedError):
                if len(conn.out) < 2 and conn.block < count:
                    self._seal(conn, transfer, cipher)  # while the kernel drains the socket
                return
            self.counters.add("bytes_out", sent)
            conn.out_sent += sent
            if conn.out_sent == head.nbytes:
                conn.out.popleft()
                conn.spare.append(buffer)
                conn.out_sent = 0

    def _seal(self, conn: _Connection, transfer: _Transfer, cipher: Cipher) -> None:
        """Encrypt block ``conn.block`` into a buffer of the connection's and queue it."""
        index = conn.block
        start = index * BLOCK_BYTES
        size = min(BLOCK_BYTES, transfer.total - start)
        buffer = conn.spare.pop() if conn.spare else bytearray(BLOCK_BYTES + TAG_BYTES)
        sealed = memoryview(buffer)[: size + TAG_BYTES]
        cipher.encrypt_into(
            nonce(index),
            self._plaintext(transfer, start, size),
            associated_data(transfer.token, index, transfer.total),
            sealed,
        )
        conn.out.append((buffer, sealed))
        conn.block = index + 1

    def _plaintext(self, transfer: _Transfer, start: int, size: int) -> memoryview:
        """Bytes [start, start + size) of the transfer: a view when one buffer holds them, else gathered."""
        offset = 0
        for view in transfer.views:
            if start < offset + view.nbytes:
                if start + size <= offset + view.nbytes:
                    return view[start - offset : start - offset + size]
                break
            offset += view.nbytes
        if len(self._scratch) < size:
            self._scratch = bytearray(BLOCK_BYTES)
        out, filled, offset = memoryview(self._scratch)[:size], 0, 0
        for view in transfer.views:
            lo, hi = max(start, offset), min(start + size, offset + view.nbytes)
            if lo < hi:
                out[filled : filled + hi - lo] = view[lo - offset : hi - offset]
                filled += hi - lo
            offset += view.nbytes
        return out

    def _finish(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        assert conn.transfer is not None
        _release(conn.transfer)
        conn.transfer, conn.idle_since = None, time.monotonic()
        conn.served += 1
        self.counters.add("bulk_sent")
        selector.modify(conn.sock, selectors.EVENT_READ)

    def _sweep(self, selector: selectors.BaseSelector, connections: dict[int, _Connection]) -> None:
        now = time.monotonic()
        for conn in list(connections.values()):
            if conn.transfer is not None and now >= conn.transfer.expires:
                self._drop(selector, connections, conn, "its transfer expired before the requester read it")
            elif (
                conn.transfer is None
                and (conn.hello or conn.owner is None)
                and now - conn.idle_since >= HELLO_TIMEOUT_S
            ):
                self._drop(selector, connections, conn, "it sent no token in time")
            elif conn.transfer is None and now - conn.idle_since >= IDLE_TIMEOUT_S:
                self._drop(selector, connections, conn, "")  # the requester may reconnect
        with self._lock:
            self._expire(now)

    def _drop(
        self,
        selector: selectors.BaseSelector,
        connections: dict[int, _Connection],
        conn: _Connection,
        reason: str,
        counter: str = "bulk_dropped",
    ) -> None:
        if reason:
            self.counters.add(counter)
            self._log(30, ("bulk_drop", reason[:40]), "%s: bulk: closed a connection: %s", self.name, reason)
        if connections.get(conn.sock.fileno()) is conn:
            del connections[conn.sock.fileno()]
        try:
            selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        if conn.transfer is not None:
            _release(conn.transfer)
            conn.transfer = None
        conn.out.clear()
        conn.spare.clear()


def _release(transfer: _Transfer) -> None:
    hold, transfer.hold = transfer.hold, None
    transfer.views, transfer.cipher = [], None
    if hold is not None:
        hold.release()


EVICTED_ATTEMPTS = 4  # connections one receive() opens at most while each is reset before its first byte


class _Closed(Exception):
    def __init__(self, got: int) -> None:
        self.got = got


class _Progress:
    """How far one transfer has come, by when it must have started, and by when it must be over."""

    __slots__ = ("got", "total", "first_byte_by", "stream_by", "deadline")

    def __init__(self, total: int, first_byte_by: float, stream_by: float, deadline: float) -> None:
        self.got, self.total, self.first_byte_by, self.deadline = 0, total, first_byte_by, deadline
        self.stream_by = stream_by


class BulkReceiver:
    """Reads bulk transfers into the caller's buffers; one connection per peer, reused. Owned by one thread."""

    def __init__(self, name: str = "dpwa") -> None:
        self.name = name
        self._socks: dict[tuple[str, int], socket.socket] = {}
        self._staging: memoryview | None = None  # a sealed block as it arrives, before it is authenticated

    def receive(
        self,
        host: str,
        port: int,
        token: bytes,
        out: np.ndarray,
        deadline: float,
        check: Callable[[int, int], None] = lambda start, end: None,
        cancelled: Callable[[], bool] = lambda: False,
        *,
        key: bytes | None = None,
        first_byte_by: float | None = None,
        stream_by: float | None = None,
    ) -> None:
        """Claim transfer `token` at host:port and read exactly ``out.nbytes`` bytes into `out` by `deadline`.

        With `key` the stream is sealed: each block is authenticated and decrypted into `out` before
        `check` sees it. `check(start, end)` runs on each block as soon as it is in (byte offsets; it may
        raise ProtocolError to stop). The first byte must arrive by `first_byte_by`, and the last by
        `stream_by` (both default to the deadline): a stream that is slower than that, or stalls after any
        number of bytes, fails then with BulkError, while the caller still has the time from `stream_by`
        to the deadline to ask over ZeroMQ. A stream can be slowed, never stopped.

        Raises BulkError when the stream fails (the caller may ask over ZeroMQ instead), RequestTimeout
        at the deadline, RequestCancelled, or what `check` raises; the connection is forgotten on any
        failure, and what `out` holds then must not be used.
        """
        where = (host, port)
        view = out.reshape(-1).view(np.uint8).data
        for attempt in range(1, EVICTED_ATTEMPTS + 1):
            reused = where in self._socks
            progress = _Progress(
                view.nbytes,
                first_byte_by if first_byte_by is not None else deadline,
                stream_by if stream_by is not None else deadline,
                deadline,
            )
            try:
                sock = self._socks.get(where) or self._connect(host, port, min(deadline, progress.first_byte_by))
                self._socks[where] = sock
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(token)
                if key is None:
                    self._read_plain(sock, view, progress, check, cancelled)
                else:
                    self._read_sealed(sock, view, progress, check, cancelled, Cipher(key), token, f"{host}:{port}")
                return
            except _Closed as exc:
                self.forget(where)
                if reused and attempt == 1 and exc.got == 0:
                    continue  # the server had closed our idle connection: connect again, once
                raise BulkError(f"{self.name}: {host}:{port} closed the bulk stream after {exc.got} bytes") from None
            except (TransportError, ProtocolError):
                self.forget(where)
                raise
            except (ConnectionResetError, BrokenPipeError) as exc:
                self.forget(where)
                if progress.got == 0 and attempt < EVICTED_ATTEMPTS and time.monotonic() < deadline:
                    continue  # reset before a byte came: evicted by a flood of silent connections; again
                raise BulkError(f"{self.name}: bulk transfer from {host}:{port} failed: {exc}") from None
            except OSError as exc:
                self.forget(where)
                raise BulkError(f"{self.name}: bulk transfer from {host}:{port} failed: {exc}") from None

    def _read_plain(
        self,
        sock: socket.socket,
        view: memoryview,
        progress: _Progress,
        check: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> None:
        for index in range(block_count(view.nbytes)):
            start = index * BLOCK_BYTES
            end = min(view.nbytes, start + BLOCK_BYTES)
            self._fill(sock, view[start:end], progress, cancelled)
            check(start, end)  # while the next block is on the wire

    def _read_sealed(
        self,
        sock: socket.socket,
        view: memoryview,
        progress: _Progress,
        check: Callable[[int, int], None],
        cancelled: Callable[[], bool],
        cipher: Cipher,
        token: bytes,
        where: str,
    ) -> None:
        if self._staging is None:
            self._staging = memoryview(bytearray(BLOCK_BYTES + TAG_BYTES))
        total, count = view.nbytes, block_count(view.nbytes)
        for index in range(count):
            start = index * BLOCK_BYTES
            end = min(total, start + BLOCK_BYTES)
            sealed = self._staging[: end - start + TAG_BYTES]
            self._fill(sock, sealed, progress, cancelled)
            try:  # authenticated before a byte of it is used; the next block arrives meanwhile
                cipher.decrypt_into(nonce(index), sealed, associated_data(token, index, total), view[start:end])
            except InvalidTag:
                raise BulkError(
                    f"{self.name}: block {index + 1} of {count} from {where} failed authentication "
                    "(forged, replayed, reordered, cut, or sealed with another key)"
                ) from None
            check(start, end)

    def _fill(self, sock: socket.socket, view: memoryview, progress: _Progress, cancelled: Callable[[], bool]) -> None:
        """Read exactly ``view.nbytes`` bytes into `view`, looking at the deadlines and the cancel flag."""
        got = 0
        while got < view.nbytes:
            if cancelled():
                raise RequestCancelled(f"{self.name}: bulk transfer cancelled")
            now = time.monotonic()
            if now >= progress.deadline:
                raise RequestTimeout(
                    f"{self.name}: bulk transfer timed out after {progress.got} of {progress.total} bytes"
                )
            if not progress.got and now >= progress.first_byte_by:
                raise BulkError(f"{self.name}: the bulk stream sent nothing in time")
            if now >= progress.stream_by:
                raise BulkError(
                    f"{self.name}: the bulk stream was not over in time ({progress.got} of {progress.total} bytes)"
                )
            limit = min(progress.deadline, progress.stream_by)
            if not progress.got:
                limit = min(limit, progress.first_byte_by)
            sock.settimeout(min(limit - now, POLL_SLICE_S))
            try:
                n = sock.recv_into(view[got:], view.nbytes - got)
            except TimeoutError:
                continue  # look at the deadlines and the cancel flag again
            if n == 0:
                raise _Closed(progress.got)
            got += n
            progress.got += n

    def _connect(self, host: str, port: int, by: float) -> socket.socket:
        timeout = by - time.monotonic()
        if timeout <= 0:
            raise BulkError(f"{self.name}: no time left to connect to {host}:{port}")
        sock = socket.create_connection((host.strip("[]"), port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def forget(self, key: tuple[str, int]) -> None:
        sock = self._socks.pop(key, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for key in list(self._socks):
            self.forget(key)
