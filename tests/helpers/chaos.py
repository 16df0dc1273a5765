"""A chaos proxy that understands ZeroMQ's framing, for tests: it acts on whole messages by kind.

It forwards TCP connections from its own free port on 127.0.0.1 to a target
port, parses the ZMTP 3 stream in both directions (the 64-byte greeting, then
frames: a flags byte, a 1- or 8-byte size, the body), and groups frames into
messages. Each message that carries a dpwa header (plaintext: use it with
``insecure: true``) is classified by its ``kind`` (``exchange``, ``params``,
``confirm``, ``decision``, ...), and a rule per kind decides what happens to it:

* ``drop``: the message is lost; the connection is cut before it is forwarded
  (TCP cannot lose one message and keep the stream, so a loss is a cut);
* ``cut_after``: the message arrives, then the connection is cut (what follows is lost);
* ``delay``: the message is held for up to ``max_delay_s`` (the stream behind it waits too).

ZMTP commands (handshake, heartbeats) pass untouched. Every action is counted
in ``stats[(kind, action)]``, so a test can check that the chaos happened.
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from helpers.ports import fresh_listener


@dataclass
class Rule:
    drop: float = 0.0  # probability that a message is lost (its connection cut before it)
    cut_after: float = 0.0  # probability that the connection is cut right after it
    delay: float = 0.0  # probability that it is held back
    max_delay_s: float = 0.0


class _Stream:
    """Parses one direction of a ZMTP 3 connection into (kind, raw bytes) units."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.greeting_left = 64  # greeting bytes still to pass: each side sends its greeting in parts
        self.frames: list[tuple[bytes, bytes]] = []  # (raw, body) of the message being assembled

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        self.buf += data
        out: list[tuple[str, bytes]] = []
        if self.greeting_left:
            part = bytes(self.buf[: self.greeting_left])
            del self.buf[: len(part)]
            self.greeting_left -= len(part)
            if part:
                out.append(("greeting", part))
            if self.greeting_left:
                return out
        while True:
            if len(self.buf) < 2:
                return out
            flags = self.buf[0]
            if flags & 0x02:
                if len(self.buf) < 9:
                    return out
                size, head = struct.unpack(">Q", bytes(self.buf[1:9]))[0], 9
            else:
                size, head = self.buf[1], 2
            if len(self.buf) < head + size:
                return out
            raw = bytes(self.buf[: head + size])
            body = raw[head:]
            del self.buf[: head + size]
            if flags & 0x04:  # a command: handshake or heartbeat
                out.append(("command", raw))
                continue
            self.frames.append((raw, body))
            if not flags & 0x01:  # the last frame of the message
                frames, self.frames = self.frames, []
                out.append((_kind(frames), b"".join(r for r, _ in frames)))


def _kind(frames: list[tuple[bytes, bytes]]) -> str:
    for _, body in frames:
        if body:
            try:
                header = msgpack.unpackb(body, raw=False)
            except Exception:
                return "?"
            return str(header.get("kind", "?")) if isinstance(header, dict) else "?"
    return "?"


class ChaosProxy:
    def __init__(self, target_port: int, rules: dict[str, Rule] | None = None, seed: int = 0) -> None:
        self.target_port = target_port
        self.rules = dict(rules or {})
        self.enabled = True
        self.stats: collections.Counter[tuple[str, str]] = collections.Counter()
        self._rng = random.Random(seed)
        self._plans: collections.defaultdict[str, collections.deque[str]] = collections.defaultdict(collections.deque)
        self._hooks: dict[str, Callable[[], object]] = {}
        self._lock = threading.Lock()
        self._listener = fresh_listener()  # never a port a test drew for a node
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="chaos-accept", daemon=True)
        self._accept.start()

    def plan(self, kind: str, *actions: str) -> None:
        """The next messages of `kind` get these actions, in order ("pass", "drop", "cut_after"), before any rule."""
        with self._lock:
            self._plans[kind].extend(actions)

    def on(self, kind: str, callback: Callable[[], object]) -> None:
        """Call `callback()` (on the proxy's thread) each time a message of `kind` has been forwarded."""
        with self._lock:
            self._hooks[kind] = callback

    def counts(self) -> collections.Counter[tuple[str, str]]:
        """A copy of ``stats``, safe to read while the proxy's threads still count."""
        with self._lock:
            return collections.Counter(self.stats)

    def heal(self) -> None:
        """From now on, forward everything untouched."""
        self.enabled = False

    def _decide(self, kind: str) -> tuple[str, float]:
        rule = self.rules.get(kind)
        with self._lock:
            if self._plans[kind]:
                action = self._plans[kind].popleft()
                self.stats[(kind, action)] += 1
                return action, 0.0
            if not self.enabled or rule is None:
                return "pass", 0.0
            u = self._rng.random()
            if u < rule.drop:
                action, delay = "drop", 0.0
            elif u < rule.drop + rule.cut_after:
                action, delay = "cut_after", 0.0
            elif u < rule.drop + rule.cut_after + rule.delay:
                action, delay = "delay", self._rng.uniform(0, rule.max_delay_s)
            else:
                action, delay = "pass", 0.0
            self.stats[(kind, action)] += 1
            return action, delay

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.settimeout(0.1)
            pair = (client, server)
            with self._lock:
                self._sockets.update(pair)
            for src, dst in ((client, server), (server, client)):
                t = threading.Thread(target=self._pump, args=(src, dst, pair), name="chaos-pump", daemon=True)
                self._threads.append(t)
                t.start()

    def _cut(self, pair: tuple[socket.socket, socket.socket]) -> None:
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        with self._lock:
            self._sockets.difference_update(pair)

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple[socket.socket, socket.socket]) -> None:
        stream = _Stream()
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                for kind, raw in stream.feed(data):
                    if kind in ("greeting", "command"):
                        dst.sendall(raw)
                        continue
                    action, delay = self._decide(kind)
                    if action == "drop":
                        self._cut(pair)
                        return
                    if action == "delay":
                        deadline = time.monotonic() + delay
                        while time.monotonic() < deadline and not self._stop.is_set():
                            self._stop.wait(min(0.01, max(0.0, deadline - time.monotonic())))
                    dst.sendall(raw)
                    hook = self._hooks.get(kind)
                    if hook is not None:
                        hook()
                    if action == "cut_after":
                        self._cut(pair)
                        return
        except OSError:
            pass
        self._cut(pair)

    def close(self) -> None:
        self._stop.set()
        self._accept.join(5)
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(5)
