"""Ports a test drew for its nodes, kept out of the listeners the test helpers open afterwards.

A test draws its nodes' ports first (free a moment ago, then released) and opens its proxies next:
each proxy listens on a port the kernel picks from the same range, and the kernel may hand it one
of those just released. The node that should own that port then fails to bind ("Address already in
use"); CI saw exactly that once. The helpers' listeners skip the ports drawn recently instead.
"""

from __future__ import annotations

import collections
import socket

RECENT = 512  # the ports remembered: far more than one test draws, far fewer than the kernel's range
_drawn: collections.deque[int] = collections.deque(maxlen=RECENT)


def remember(port: int) -> int:
    """Note a port drawn for a node; returns it."""
    _drawn.append(port)
    return port


def fresh_listener(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound (SO_REUSEADDR, not yet listening) to a port the kernel picked on `host`
    that no test drew recently. Bounded: a skipped port stays held until the end, so each draw
    differs, and there are at most RECENT of them."""
    held: list[socket.socket] = []
    try:
        for _ in range(RECENT + 1):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            if sock.getsockname()[1] not in _drawn:
                return sock
            held.append(sock)
    finally:
        for s in held:
            s.close()
    raise OSError(f"no port on {host} outside the {len(_drawn)} drawn recently")
