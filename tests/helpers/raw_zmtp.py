"""A minimal ZMTP 3.0 client over a plain socket, for attacks libzmq's own sockets cannot make.

A libzmq client always reads what its peer sends (its I/O thread drains the
connection into the socket's queue), so it cannot play a peer that asks for
large replies and never reads them. This one speaks just enough of ZMTP 3.0
(RFC 23) with the NULL mechanism (RFC 23 section "NULL security mechanism")
to be a ``REQ`` peer of a ROUTER, over TCP or an AF_UNIX (ipc) socket, and
then does only what a test tells it:

* :meth:`RawZmtp.handshake`: the 64-byte greeting both ways, then our
  ``READY`` command (``Socket-Type``) and the server's ``READY``;
* :meth:`RawZmtp.send_message`: one message, its frames sent with the MORE flag
  but the last;
* :meth:`RawZmtp.send_frame`: one frame, with or without MORE: a message that
  never ends is just frames with MORE;
* :meth:`RawZmtp.read_message`: read one message (only when a test wants to).

Nothing here reads in the background: bytes the server sends stay in the
kernel's buffers (small ones: ``rcvbuf``) until a test reads them.
"""

from __future__ import annotations

import socket
import struct
import time

__all__ = ["RawZmtp", "ZmtpError", "frame_bytes", "frames_blob", "greeting", "ready_command"]

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
FLAG_MORE, FLAG_LONG, FLAG_COMMAND = 0x01, 0x02, 0x04


class ZmtpError(RuntimeError):
    """The server broke off the handshake, or sent something this client does not understand."""


def greeting(mechanism: bytes = b"NULL", as_server: bool = False) -> bytes:
    """The 64-byte ZMTP 3.0 greeting: signature, version 3.0, mechanism, as-server, filler."""
    assert len(mechanism) <= 20
    return SIGNATURE + bytes([3, 0]) + mechanism.ljust(20, b"\x00") + bytes([int(as_server)]) + b"\x00" * 31


def _frame_head(flags: int, size: int) -> bytes:
    if size > 255:
        return bytes([flags | FLAG_LONG]) + struct.pack(">Q", size)
    return bytes([flags, size])


def frame_bytes(body: bytes, more: bool = False, command: bool = False) -> bytes:
    """One frame on the wire: flags, size (1 or 8 bytes), body."""
    flags = (FLAG_MORE if more else 0) | (FLAG_COMMAND if command else 0)
    return _frame_head(flags, len(body)) + body


def frames_blob(body_size: int, count: int, more: bool = True) -> bytes:
    """`count` frames of `body_size` zero bytes, each with the MORE flag: one piece of a message that never ends."""
    return frame_bytes(b"\x00" * body_size, more=more) * count


def ready_command(socket_type: bytes = b"REQ", identity: bytes | None = None) -> bytes:
    """A READY command frame with its metadata properties."""
    body = b"\x05READY"
    properties = [(b"Socket-Type", socket_type)]
    if identity is not None:
        properties.append((b"Identity", identity))
    for name, value in properties:
        body += bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return frame_bytes(body, command=True)


class RawZmtp:
    """One raw connection. Use it from one thread; close it (the socket closes at once, RST-free).

    Args:
        address: ``("127.0.0.1", port)`` for TCP, or a filesystem path for an ipc (AF_UNIX) endpoint.
        rcvbuf: SO_RCVBUF, set before connecting (small: the server's replies back up soon).
        timeout_s: the socket timeout of every blocking call (connect, send, the handshake's reads).
    """

    def __init__(self, address: tuple[str, int] | str, *, rcvbuf: int | None = 4096, timeout_s: float = 5.0) -> None:
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if rcvbuf is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.settimeout(timeout_s)
            self.sock.connect(address)
        except BaseException:
            self.sock.close()
            raise
        self.address = address
        self.sent = 0  # bytes the kernel accepted from us, handshake included
        self.server_ready: dict[bytes, bytes] = {}

    # ----------------------------------------------------------------- handshake

    def handshake(self, socket_type: bytes = b"REQ", mechanism: bytes = b"NULL") -> dict[bytes, bytes]:
        """Greeting and READY, as a NULL-mechanism `socket_type` peer; returns the server's READY properties."""
        self.send_raw(greeting(mechanism))
        theirs = self.recv_exact(64)
        if theirs[:1] != b"\xff" or theirs[9:10] != b"\x7f":
            raise ZmtpError(f"not a ZMTP greeting: {theirs[:12]!r}")
        if theirs[10] < 3:
            raise ZmtpError(f"the server speaks ZMTP {theirs[10]}.{theirs[11]}")
        their_mechanism = theirs[12:32].rstrip(b"\x00")
        if their_mechanism != mechanism:
            raise ZmtpError(f"the server wants mechanism {their_mechanism!r}")
        self.send_raw(ready_command(socket_type))
        flags, body = self.read_frame()
        if not flags & FLAG_COMMAND:
            raise ZmtpError("expected the server's READY command, got a message frame")
        name_len = body[0]
        name = body[1 : 1 + name_len]
        if name != b"READY":
            raise ZmtpError(f"the server answered {name!r}: {body[1 + name_len :][:80]!r}")
        self.server_ready = _properties(body[1 + name_len :])
        return self.server_ready

    # ----------------------------------------------------------------- sending

    def send_raw(self, data: bytes | memoryview) -> None:
        self.sock.sendall(data)
        self.sent += len(data)

    def send_frame(self, body: bytes | memoryview, more: bool) -> None:
        """One message frame; `more` says another frame of the same message follows."""
        self.send_raw(_frame_head(FLAG_MORE if more else 0, len(body)))
        self.send_raw(body)

    def send_message(self, frames: list[bytes]) -> None:
        """A whole message: every frame but the last with MORE."""
        data = b"".join(frame_bytes(f, more=i < len(frames) - 1) for i, f in enumerate(frames))
        self.send_raw(data)

    def stream(self, blob: bytes, total: int) -> int:
        """Send `blob` again and again until `total` bytes went out or the server cut the connection.

        Returns the bytes the kernel accepted; stops quietly at EPIPE or ECONNRESET.
        """
        start = self.sent
        try:
            while self.sent - start < total:
                self.send_raw(blob)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return self.sent - start

    def send_request(self, header: bytes, *payload: bytes) -> None:
        """What a REQ socket sends: the empty delimiter, the header, the payload frames."""
        self.send_message([b"", header, *payload])

    # ----------------------------------------------------------------- reading (only when asked)

    def recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(n - got)
            if not chunk:
                raise ZmtpError(f"the server closed the connection after {got} of {n} bytes")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def read_frame(self) -> tuple[int, bytes]:
        flags = self.recv_exact(1)[0]
        size = struct.unpack(">Q", self.recv_exact(8))[0] if flags & FLAG_LONG else self.recv_exact(1)[0]
        if size > 1 << 30:
            raise ZmtpError(f"a frame of {size} bytes")
        return flags, self.recv_exact(size)

    def read_message(self, timeout_s: float = 5.0) -> list[bytes]:
        """The next message's frames (commands such as PING are skipped), within `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        frames: list[bytes] = []
        for _ in range(10_000):  # bounded: commands and frames of one message
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            flags, body = self.read_frame()
            if flags & FLAG_COMMAND:
                continue
            frames.append(body)
            if not flags & FLAG_MORE:
                return frames
        raise ZmtpError("no end of message within 10,000 frames")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> RawZmtp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _properties(data: bytes) -> dict[bytes, bytes]:
    out, i = {}, 0
    while i < len(data):
        n = data[i]
        name = data[i + 1 : i + 1 + n]
        i += 1 + n
        (size,) = struct.unpack(">I", data[i : i + 4])
        out[name] = data[i + 4 : i + 4 + size]
        i += 4 + size
    return out
