"""A relay's rules, apart from its sockets: the messages, who may register, which port it gets, how fast.

Pure: no socket, thread or clock (every time is an argument). :mod:`dpwa.wire.relay` drives these with
sockets; the tests here need none.

The relay protocol runs over plain TCP, beside ZeroMQ, between a member that nobody can dial (the
*relayed* member) and a member that can be dialled (the *relay*):

1. The relayed member dials the relay's port. The relay speaks first: a :func:`challenge`.
2. The member answers ``hello``: its name, the port it would like (the one it had, after a reconnect),
   and in a cluster with keys its CURVE public key, its member certificate and a :func:`proof` that it holds
   the key's secret (an HMAC of the challenge under the X25519 secret the two keys share).
3. The relay grants a port of its own (:class:`Ports`) and answers ``ok`` with it, or ``no`` with a reason.
   That connection is the member's *control* connection; the relay listens on the granted port for it.
4. Whoever connects to the granted port (any peer's ZeroMQ socket) is held, and the relay sends the member
   ``open`` with a fresh token over the control connection. The member dials the relay's port again, sends
   ``data`` with that token, and the relay splices the two connections: from then on it only moves bytes.
   The member splices its end to its own server, on its own machine.

So the relay never terminates the peers' ZeroMQ sessions: with keys, CURVE runs end to end, from the peer
to the relayed member, and the relay moves ciphertext it can neither read nor change undetected.

Every message is a 4-byte big-endian length and a msgpack map, at most :data:`MAX_MESSAGE` bytes; each field
is checked (:func:`check`). Both ends send ``ping`` every :data:`PING_S` on the control connection; one
silent for :data:`SILENT_S` is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from .errors import ProtocolError

__all__ = [
    "CHALLENGE_BYTES",
    "MAX_MESSAGE",
    "PING_S",
    "SILENT_S",
    "TOKEN_BYTES",
    "Hello",
    "Ports",
    "Reader",
    "TokenBucket",
    "check",
    "encode",
    "parse_ports",
    "proof",
]

MAGIC = b"dpwa-relay-1"  # this protocol and its version, in every proof
MAX_MESSAGE = 4096  # bytes a control message may have (a certificate is about 300)
CHALLENGE_BYTES = 16
TOKEN_BYTES = 16
PROOF_BYTES = 32  # HMAC-SHA256
PING_S = 2.0  # each end of a control connection says something at least this often
SILENT_S = 3 * PING_S  # a control connection silent this long is closed (and its port let go)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KINDS: Mapping[str, tuple[str, ...]] = {  # each message kind and its fields
    "challenge": ("c",),
    "hello": ("name", "want", "key", "cert", "proof"),
    "ok": ("port",),
    "no": ("why",),
    "open": ("token",),
    "data": ("token",),
    "ping": (),
}


def encode(kind: str, **fields: Any) -> bytes:
    """One message: its length, then the msgpack map of `kind` and `fields`."""
    body = msgpack.packb({"t": kind, **fields}, use_bin_type=True)
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"relay message {kind} of {len(body)} bytes is over {MAX_MESSAGE}")
    return struct.pack("!I", len(body)) + body


class Reader:
    """Messages out of a byte stream, as they complete. Holds at most one message's bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        """The messages that `data` completes, each checked (ProtocolError: a bad one; drop the connection)."""
        self._buf += data
        while len(self._buf) >= 4:
            (size,) = struct.unpack_from("!I", self._buf)
            if size > MAX_MESSAGE:
                raise ProtocolError("too_large", f"a relay message of {size} bytes (at most {MAX_MESSAGE})")
            if len(self._buf) < 4 + size:
                return
            body = bytes(self._buf[4 : 4 + size])
            del self._buf[: 4 + size]
            yield check(body)

    def leftover(self) -> bytes:
        """The bytes after the last message (a data connection's first bytes of its stream)."""
        out = bytes(self._buf)
        self._buf.clear()
        return out


def check(body: bytes) -> dict[str, Any]:
    """A message's map, its kind known and its fields of the right types (ProtocolError otherwise)."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ProtocolError("malformed", f"not a msgpack map: {exc}") from None
    if not isinstance(msg, dict) or msg.get("t") not in _KINDS:
        raise ProtocolError("bad_kind", f"not a relay message: {str(msg)[:80]}")
    kind = msg["t"]
    extra = set(msg) - {"t", *_KINDS[kind]}
    if extra:
        raise ProtocolError("bad_field", f"{kind} has unknown fields {sorted(extra)}")
    for key in ("c", "token"):
        if key in msg and not (isinstance(msg[key], bytes) and len(msg[key]) == TOKEN_BYTES):
            raise ProtocolError("bad_field", f"{kind}.{key} must be {TOKEN_BYTES} bytes")
    if kind in ("challenge", "open", "data") and not all(k in msg for k in _KINDS[kind]):
        raise ProtocolError("bad_field", f"{kind} lacks {_KINDS[kind]}")
    for key in ("want", "port"):
        if key in msg and not (isinstance(msg[key], int) and 0 <= msg[key] <= 65535):
            raise ProtocolError("bad_field", f"{kind}.{key} must be a port in 0..65535, got {msg[key]!r:.40}")
    if kind == "ok" and "port" not in msg:
        raise ProtocolError("bad_field", "ok lacks port")
    if kind == "no" and not isinstance(msg.get("why"), str):
        raise ProtocolError("bad_field", "no.why must be text")
    if kind == "hello":
        Hello.of(msg)  # raises on a bad one
    return msg


@dataclass(frozen=True)
class Hello:
    """A member's registration, checked."""

    name: str
    want: int  # the port it had (0: any)
    key: str | None  # its CURVE public key, Z85 (a cluster with keys)
    cert: str | None  # its member certificate (a cluster with keys)
    proof: bytes | None  # :func:`proof` over the relay's challenge (a cluster with keys)

    @classmethod
    def of(cls, msg: Mapping[str, Any]) -> Hello:
        name, want, key, cert, made = (msg.get(k) for k in ("name", "want", "key", "cert", "proof"))
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ProtocolError("bad_field", f"hello.name must be a node name, got {name!r:.80}")
        if not isinstance(want, int) or not 0 <= want <= 65535:
            raise ProtocolError("bad_field", f"hello.want must be a port in 0..65535, got {want!r:.40}")
        if key is not None and not (isinstance(key, str) and len(key) == 40):
            raise ProtocolError("bad_field", "hello.key must be a 40-character Z85 key")
        if cert is not None and not (isinstance(cert, str) and len(cert) <= MAX_MESSAGE):
            raise ProtocolError("bad_field", "hello.cert must be text")
        if made is not None and not (isinstance(made, bytes) and len(made) == PROOF_BYTES):
            raise ProtocolError("bad_field", f"hello.proof must be {PROOF_BYTES} bytes")
        return cls(name, want, key, cert, made)


def proof(own_secret: bytes, their_public: bytes, challenge: bytes, name: str) -> bytes:
    """What proves, to the holder of `their_public`'s secret, that we hold `own_secret` (raw 32-byte X25519
    keys, as CURVE's): an HMAC-SHA256 of the challenge and `name` under the secret the two keys share."""
    shared = X25519PrivateKey.from_private_bytes(own_secret).exchange(X25519PublicKey.from_public_bytes(their_public))
    return hmac.new(shared, MAGIC + challenge + name.encode(), hashlib.sha256).digest()


def proof_holds(own_secret: bytes, their_public: bytes, challenge: bytes, name: str, made: bytes | None) -> bool:
    """Does `made` prove that `name` holds the secret of `their_public`? (Constant time.)"""
    if made is None:
        return False
    try:
        want = proof(own_secret, their_public, challenge, name)
    except ValueError:  # not a key (all zeros, say)
        return False
    return hmac.compare_digest(want, made)


def parse_ports(text: str) -> range:
    """``FIRST-LAST`` (both in 1..65535, FIRST <= LAST, at most 1024) as a range; ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", text)
    if match is None:
        raise ValueError(f"must be FIRST-LAST, like 45101-45108, got {text!r:.40}")
    first, last = int(match.group(1)), int(match.group(2))
    if not 1 <= first <= last <= 65535 or last - first >= 1024:
        raise ValueError(f"must be FIRST-LAST within 1..65535, FIRST <= LAST, at most 1024 ports, got {text!r:.40}")
    return range(first, last + 1)


class Ports:
    """Which member holds which of the relay's ports. A member gets the port it asks for when it is free (the one
    it had: its endpoint stays the same across reconnects and relay restarts), else the one it had here
    before, else the lowest free one."""

    def __init__(self, ports: range) -> None:
        self._ports = ports
        self._held: dict[str, int] = {}  # member -> its port now
        self._had: dict[str, int] = {}  # member -> the port it last held here (bounded by the ports' count)

    def grant(self, name: str, want: int) -> int | None:
        """A port for `name`, or None when it holds one already or none is free."""
        if name in self._held:
            return None
        taken = set(self._held.values())
        choices = [want, self._had.get(name, 0), *self._ports]
        port = next((p for p in choices if p in self._ports and p not in taken), None)
        if port is not None:
            self._held[name] = port
            self._had = {n: p for n, p in self._had.items() if p != port and n != name}
            self._had[name] = port
        return port

    def release(self, name: str) -> None:
        self._held.pop(name, None)

    def holder(self, port: int) -> str | None:
        return next((n for n, p in self._held.items() if p == port), None)

    def held(self) -> dict[str, int]:
        return dict(self._held)


class TokenBucket:
    """At most `rate` bytes a second on average, in bursts of at most `burst` bytes (rate 0: no bound)."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = rate, burst
        self._tokens, self._at = burst, now

    def _fill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def allowance(self, now: float) -> int:
        """How many bytes may move now."""
        if self.rate <= 0:
            return 1 << 30
        self._fill(now)
        return max(0, int(self._tokens))

    def spend(self, n: int, now: float) -> None:
        if self.rate > 0:
            self._fill(now)
            self._tokens -= n

    def wait_s(self, now: float) -> float:
        """How long until a byte may move (0: now)."""
        if self.rate <= 0:
            return 0.0
        self._fill(now)
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self.rate
