"""A data path beside the control messages: large payloads as raw TCP streams, for unencrypted clusters.

ZeroMQ moves a 44.7 MB snapshot over loopback in about 1.4 times the time
of a raw TCP stream of the same bytes, and then the receiver still copies
and checks it. A raw stream can land the bytes straight in the buffer they
are blended from, and the receiver can check each block as it arrives,
while the next is on the wire. So where messages travel unencrypted anyway
(``insecure: true``), a requester may ask for a large snapshot by stream:

1. its request (over ZeroMQ) says ``bulk``; the server answers, over
   ZeroMQ, with the snapshot's header, the port of its :class:`BulkServer`
   and a fresh 16-byte token, and hands the leased snapshot to the bulk
   server;
2. the requester (:class:`BulkReceiver`) connects to that port (or reuses
   its connection), sends the token, and reads exactly the announced number
   of bytes into its own buffer.

A token is unguessable, serves once, and expires with the request's
deadline (plus a second), releasing the snapshot. Nobody else is trusted
either: a connection that does not send a known token within
:data:`HELLO_TIMEOUT_S` is closed, as is one that stops reading (its
transfer expires); at most ``max_connections`` are open, and each sender
name has at most ``max_per_sender`` transfers pending. Only the requester
that got the token over the authenticated ZeroMQ channel can claim it.
Under CURVE this path is never used: it would bypass the encryption.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..logs import RateLimitedLog, logger
from ..stats import Counters
from .messages import ProtocolError
from .server import POLL_SLICE_S, Hold, Refused, TransportError

__all__ = ["BLOCK_BYTES", "HELLO_TIMEOUT_S", "TOKEN_BYTES", "BulkReceiver", "BulkServer"]

TOKEN_BYTES = 16
HELLO_TIMEOUT_S = 2.0  # a new connection must send its whole token this soon (a reused one: its next token)
BLOCK_BYTES = 1 << 20  # the receiver checks (and the server sends) this much at a time


@dataclass
class _Transfer:
    token: bytes
    sender: str
    views: list[memoryview]
    hold: Hold | None
    expires: float


@dataclass
class _Connection:
    sock: socket.socket
    hello: bytearray = field(default_factory=bytearray)
    idle_since: float = field(default_factory=time.monotonic)
    transfer: _Transfer | None = None
    part: int = 0
    offset: int = 0
    served: int = 0  # transfers completed on this connection


class BulkServer:
    """Streams leased snapshots to requesters holding a token, from one thread that owns every socket.

    Args:
        host: the address to listen on (the node's bind address); the port is picked free.
        name: for logs and the thread's name.
        counters: where to count transfers.
        max_per_sender, max_pending: transfers waiting or in progress, per sender name and in all.
        max_connections: open connections at most; more are closed at once.
    """

    def __init__(
        self,
        host: str,
        *,
        name: str = "dpwa",
        counters: Counters | None = None,
        max_per_sender: int = 3,
        max_pending: int = 12,
        max_connections: int = 32,
    ) -> None:
        self.name = name
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
        self._thread = threading.Thread(target=self._run, name=f"dpwa-bulk-{name}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- any thread (the Rx thread offers)

    def offer(self, sender: str, buffers: Sequence[Any], hold: Hold | None, ttl_s: float) -> bytes:
        """Hold `buffers` for `sender` for up to `ttl_s`; the token that claims them. Refused("busy") past the budget.

        The hold is released once the bytes are sent, or when the offer expires or fails.
        """
        token = secrets.token_bytes(TOKEN_BYTES)
        views = [memoryview(b).cast("B") for b in buffers]
        with self._lock:
            if self._stop.is_set():
                raise Refused("closing", "this node is closing")
            self._expire(time.monotonic())
            mine = sum(1 for t in self._transfers.values() if t.sender == sender)
            if mine >= self._max_per_sender or len(self._transfers) >= self._max_pending:
                raise Refused("busy", f"{mine} bulk transfers to you are still waiting")
            self._transfers[token] = _Transfer(token, sender, views, hold, time.monotonic() + ttl_s)
        return token

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
                for key, events in selector.select(POLL_SLICE_S):
                    if key.fileobj is self._listener:
                        self._accept(selector, connections)
                        continue
                    conn = connections.get(key.fd)
                    if conn is None:
                        continue
                    try:
                        if events & selectors.EVENT_READ and not self._read(selector, conn):
                            self._drop(selector, connections, conn, "")  # the requester hung up between transfers
                            continue
                        if conn.transfer is not None and events & selectors.EVENT_WRITE:
                            self._write(selector, conn)
                    except (OSError, ProtocolError) as exc:
                        self._drop(selector, connections, conn, str(exc))
                self._sweep(selector, connections)
        except Exception:  # a bug here must be loud, but must not hang close()
            logger.exception("%s: bulk thread failed", self.name)
        finally:
            for conn in list(connections.values()):
                self._drop(selector, connections, conn, "")
            selector.close()
            self._listener.close()

    def _accept(self, selector: selectors.BaseSelector, connections: dict[int, _Connection]) -> None:
        for _ in range(16):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, say: try again later
                self._log(30, ("accept", exc.errno), "%s: bulk: cannot accept a connection: %s", self.name, exc)
                return
            if len(connections) >= self._max_connections:
                self.counters.add("bulk_refused_connections")
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connections[sock.fileno()] = _Connection(sock)
            selector.register(sock, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, conn: _Connection) -> bool:
        """Read (part of) a token; False when the requester closed the connection between transfers."""
        data = conn.sock.recv(TOKEN_BYTES - len(conn.hello))
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
        conn.transfer, conn.part, conn.offset = transfer, 0, 0
        selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
        return True

    def _write(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        transfer = conn.transfer
        assert transfer is not None
        for _ in range(64):  # bounded, so other connections get their turn
            if conn.part == len(transfer.views):
                _release(transfer)
                conn.transfer, conn.idle_since = None, time.monotonic()
                conn.served += 1
                self.counters.add("bulk_sent")
                selector.modify(conn.sock, selectors.EVENT_READ)
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

    def _sweep(self, selector: selectors.BaseSelector, connections: dict[int, _Connection]) -> None:
        now = time.monotonic()
        for conn in list(connections.values()):
            if conn.transfer is not None and now >= conn.transfer.expires:
                self._drop(selector, connections, conn, "its transfer expired before the requester read it")
            elif conn.transfer is None and (conn.hello or not conn.served) and now - conn.idle_since >= HELLO_TIMEOUT_S:
                self._drop(selector, connections, conn, "it sent no token in time")
            elif conn.transfer is None and now - conn.idle_since >= 60.0:
                self._drop(selector, connections, conn, "")  # idle for a minute: the requester may reconnect
        with self._lock:
            self._expire(now)

    def _drop(
        self, selector: selectors.BaseSelector, connections: dict[int, _Connection], conn: _Connection, reason: str
    ) -> None:
        if reason:
            self.counters.add("bulk_dropped")
            self._log(30, ("bulk_drop", reason[:40]), "%s: bulk: closed a connection: %s", self.name, reason)
        connections.pop(conn.sock.fileno(), None)
        try:
            selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        if conn.transfer is not None:
            _release(conn.transfer)
            conn.transfer = None


def _release(transfer: _Transfer) -> None:
    hold, transfer.hold = transfer.hold, None
    transfer.views = []
    if hold is not None:
        hold.release()


class _Closed(Exception):
    def __init__(self, got: int) -> None:
        self.got = got


class BulkReceiver:
    """Reads bulk transfers into the caller's buffers; one connection per peer, reused. Owned by one thread."""

    def __init__(self, name: str = "dpwa") -> None:
        self.name = name
        self._socks: dict[tuple[str, int], socket.socket] = {}

    def receive(
        self,
        host: str,
        port: int,
        token: bytes,
        out: np.ndarray,
        deadline: float,
        check: Callable[[int, int], None] = lambda start, end: None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Claim transfer `token` at host:port and read exactly ``out.nbytes`` bytes into `out` by `deadline`.

        `check(start, end)` runs on each block as soon as it is in (byte offsets; it may raise
        ProtocolError to stop). Raises TransportError (and forgets the connection) on any failure.
        """
        key = (host, port)
        view = out.reshape(-1).view(np.uint8).data
        for attempt in (1, 2):
            reused = key in self._socks
            try:
                sock = self._socks.get(key) or self._connect(host, port, deadline)
                self._socks[key] = sock
                self._read(sock, token, view, deadline, check, cancelled)
                return
            except _Closed as exc:
                self.forget(key)
                if reused and attempt == 1 and exc.got == 0:
                    continue  # the server had closed our idle connection: connect again, once
                raise TransportError(
                    f"{self.name}: {host}:{port} closed the bulk stream after {exc.got} bytes"
                ) from None
            except (TransportError, ProtocolError):
                self.forget(key)
                raise
            except OSError as exc:
                self.forget(key)
                raise TransportError(f"{self.name}: bulk transfer from {host}:{port} failed: {exc}") from None

    def _read(
        self,
        sock: socket.socket,
        token: bytes,
        view: memoryview,
        deadline: float,
        check: Callable[[int, int], None],
        cancelled: Callable[[], bool],
    ) -> None:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.sendall(token)
        got, checked, total = 0, 0, view.nbytes
        while got < total:
            if cancelled():
                raise TransportError(f"{self.name}: bulk transfer cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(f"{self.name}: bulk transfer timed out after {got} of {total} bytes")
            sock.settimeout(min(remaining, POLL_SLICE_S))
            try:
                n = sock.recv_into(view[got:], total - got)
            except TimeoutError:
                continue  # look at the deadline and the cancel flag again
            if n == 0:
                raise _Closed(got)
            got += n
            while got - checked >= BLOCK_BYTES or (got == total and checked < total):
                end = min(total, checked + BLOCK_BYTES)
                check(checked, end)
                checked = end

    def _connect(self, host: str, port: int, deadline: float) -> socket.socket:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise TransportError(f"{self.name}: no time left to connect to {host}:{port}")
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
