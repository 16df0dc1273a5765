"""A fault-injecting TCP proxy on 127.0.0.1, for tests.

It forwards connections from its own free port to a target port, on one
thread, and can be switched at any time between:

* ``"pass"``: forward both ways (``delay_s`` delays each chunk from the target
  back to the client: slow replies);
* ``"refuse"``: close every connection, and every new one at once
  (a partition, or a peer that is down);
* ``"blackhole"``: accept and read, but forward nothing (a peer that
  accepts and never replies, or packets lost on the way).

It can also cut the connections once a number of bytes has flowed from the
target back to the client (a peer dying in the middle of a reply), and
record what it forwarded (to check that CURVE leaves no plaintext).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

from helpers.ports import fresh_listener


class Proxy:
    def __init__(self, target_port: int, *, capture: bool = False) -> None:
        self.target_port = target_port
        self._listener = fresh_listener()  # never a port a test drew for a node
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self.mode = "pass"
        self.delay_s = 0.0
        self.captured = bytearray() if capture else None
        self._cut_after: int | None = None
        self.cut = threading.Event()  # set when a cut happened
        self._downstream = 0  # bytes forwarded target -> client since the cut was armed
        self.downstream_total = 0  # bytes forwarded target -> client, ever
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._from_target: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- control

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "refuse", "blackhole"), mode
        with self._lock:
            self.mode = mode
            if mode == "refuse":
                self._close_all()

    def cut_after(self, nbytes: int) -> None:
        """Close every connection once `nbytes` more have flowed from the target to clients."""
        with self._lock:
            self._cut_after = nbytes
            self._downstream = 0
            self.cut.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            self._close_all()
        self._listener.close()

    # ----------------------------------------------------------------- the thread

    def _close_all(self) -> None:
        for s in list(self._pairs):
            try:
                s.close()
            except OSError:
                pass
        self._pairs.clear()
        self._from_target.clear()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        registered: set[socket.socket] = set()
        while not self._stop.is_set():
            with self._lock:
                current = set(self._pairs)
            for s in registered - current:
                try:
                    sel.unregister(s)
                except (KeyError, ValueError):
                    pass
            for s in current - registered:
                sel.register(s, selectors.EVENT_READ)
            registered = current
            for key, _ in sel.select(timeout=0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)  # only sockets are registered
                if sock is self._listener:
                    self._accept()
                else:
                    self._forward(sock)
        sel.close()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        with self._lock:
            if self.mode == "refuse":
                client.close()
                return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
        except OSError:
            client.close()
            return
        client.setblocking(False)
        upstream.setblocking(False)
        with self._lock:
            self._pairs[client] = upstream
            self._pairs[upstream] = client
            self._from_target.add(upstream)

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        with self._lock:
            other = self._pairs.get(sock)
            if other is None:
                return
            if not data:
                for s in (sock, other):
                    self._pairs.pop(s, None)
                    self._from_target.discard(s)
                    s.close()
                return
            if self.mode == "blackhole":
                return
            downstream = sock in self._from_target
            if downstream and self._cut_after is not None:
                self._downstream += len(data)
                if self._downstream >= self._cut_after:
                    self._cut_after = None
                    self._close_all()
                    self.cut.set()
                    return
            if downstream:
                self.downstream_total += len(data)
            if self.captured is not None:
                self.captured += data
            delay = self.delay_s if downstream else 0.0
        if delay:
            time.sleep(delay)  # a slow link: the delay is the fault being injected, not synchronization
        try:
            other.setblocking(True)
            other.settimeout(5)
            other.sendall(data)
            other.setblocking(False)
        except OSError:
            with self._lock:
                for s in (sock, other):
                    self._pairs.pop(s, None)
                    s.close()
