"""Bulk ports held up, for tests: a flood of silent TCP connections, each one reopened as soon as the
server closes it (:class:`Flood`), a listener that accepts and never sends (:class:`SilentListener`), and
one that sends one byte and then nothing (:class:`Trickle`).

The attack of issue 16 on a node's bulk port: `count` connections that never
send a byte, on one thread, each replaced the moment the server closes it (or
refuses it), for as long as the flood runs. Bounded in time: it stops by
itself after `limit_s`, and ``close()`` stops it at once.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time


class Flood:
    def __init__(self, port: int, count: int = 30, *, host: str = "127.0.0.1", limit_s: float = 60.0) -> None:
        self.address = (host, port)
        self.count = count
        self.opened = 0  # connections opened, the first ones included
        self.closed_by_server = 0
        self._stop = threading.Event()
        self._deadline = time.monotonic() + limit_s
        self._thread = threading.Thread(target=self._run, name="test-flood", daemon=True)
        self._thread.start()

    def _open(self, selector: selectors.BaseSelector) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(self.address)
        except BlockingIOError:
            pass
        except OSError:  # refused: count it as closed, and try again on the next turn
            sock.close()
            self.closed_by_server += 1
            return
        selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                for _ in range(self.count - len(selector.get_map())):
                    self._open(selector)
                for key, _ in selector.select(0.01):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(1)
                    except OSError:
                        data = b""
                    if not data:  # closed by the server: open another at once
                        selector.unregister(sock)
                        sock.close()
                        self.closed_by_server += 1
        finally:
            for key in list(selector.get_map().values()):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)  # only sockets are registered
                sock.close()
            selector.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the flood thread did not stop"

    def __enter__(self) -> Flood:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SilentListener:
    """Accepts connections and never sends a byte (a bulk port held up), until closed. A context manager."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> SilentListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StallingRelay:
    """Relays connections to a bulk port, passing the server's first `passed` bytes back and then nothing
    more (a link or a middlebox that stalls mid-stream), holding the connections open until closed.

    One thread with a selector, bounded by `limit_s`; ``close()`` stops it and closes every socket.
    """

    def __init__(self, port: int, passed: int = 1, *, limit_s: float = 60.0) -> None:
        self.target = ("127.0.0.1", port)
        self.passed = passed
        self.relayed = 0  # connections relayed
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._deadline = time.monotonic() + limit_s
        self._thread = threading.Thread(target=self._run, name="test-stalling-relay", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ, None)
        pairs: dict[socket.socket, tuple[socket.socket, bool]] = {}  # socket -> (its other end, from the server?)
        budget: dict[socket.socket, int] = {}  # server side -> bytes it may still pass back
        try:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                for key, _ in selector.select(0.01):
                    if key.fileobj is self.sock:
                        try:
                            client, _ = self.sock.accept()
                        except BlockingIOError:
                            continue
                        server = socket.create_connection(self.target, timeout=5)
                        pairs[client], pairs[server] = (server, False), (client, True)
                        budget[server] = self.passed
                        for end in (client, server):
                            end.setblocking(False)
                            selector.register(end, selectors.EVENT_READ, None)
                        self.relayed += 1
                        continue
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    other, from_server = pairs[sock]
                    size = min(65536, budget[sock]) if from_server else 65536
                    if size == 0:  # stalled: read nothing more from the server, keep both ends open
                        selector.unregister(sock)
                        continue
                    try:
                        data = sock.recv(size)
                    except OSError:
                        data = b""
                    if not data:
                        for end in (sock, other):
                            if end in selector.get_map():
                                selector.unregister(end)
                        continue
                    if from_server:
                        budget[sock] -= len(data)
                    other.sendall(data)
        finally:
            for end in pairs:
                end.close()
            self.sock.close()
            selector.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "the relay thread did not stop"

    def __enter__(self) -> StallingRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Trickle:
    """A bulk port that accepts, sends one byte, and then nothing (a stream that stalls once it began)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-trickle", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted.append(conn)
            try:
                conn.sendall(b"x")
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for conn in self.accepted:
            conn.close()
        self.sock.close()
