"""CURVE: key pairs, key files, and the socket options that use them.

With CURVE every connection is encrypted and authenticated. A server serves
only clients whose public key it allows (answered in its own thread by the
ZAP handler of :mod:`dpwa.wire.server`), and a client only talks to the
server key it expects.

``python -m dpwa keygen NAME`` writes ``NAME.key`` (the public key, to share)
and ``NAME.key_secret`` (the secret key, mode 0600, never shared) in the ZPL
certificate format that ``zmq.auth.load_certificate`` also reads. The shared
cluster config lists each node's *public* key and the path where that node
finds its own secret key file; secret keys never sit in the config.
"""

from __future__ import annotations

import datetime
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = ["KEY_IDENTITY", "CurveKeys", "KeyPair", "KeyFileError", "generate", "load_secret", "valid_public_key"]

KEY_IDENTITY = "key:"  # with open membership, a connection's ZAP user id: this, then its client key in Z85


class KeyFileError(ValueError):
    """A key file is missing, unsafe or does not match the config."""


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys of one endpoint: its own pair, and who may talk to it."""

    public: bytes  # this endpoint's public key, Z85
    secret: bytes  # this endpoint's secret key, Z85
    # raw 32-byte client key -> name; with `open`, a live mapping its owner changes as members come and go
    allowed: Mapping[bytes, str] = field(default_factory=dict)
    # open membership: a connection is named by its key (KEY_IDENTITY + Z85), and its requests by whose key
    # it is *now* (``allowed``, looked up per request), so members admitted later are known on it
    open: bool = False
    # with `open`: a key ``allowed`` does not hold may complete the handshake too (a newcomer, to announce
    # itself with its certificate); its requests reach only the routes that take newcomers
    newcomers: bool = False

    def server_options(self) -> dict[int, Any]:
        return {
            zmq.CURVE_SERVER: 1,
            zmq.CURVE_PUBLICKEY: self.public,
            zmq.CURVE_SECRETKEY: self.secret,
            zmq.ZAP_DOMAIN: b"dpwa",
        }

    def client_options(self, server_public: bytes) -> dict[int, Any]:
        return {
            zmq.CURVE_SERVERKEY: server_public,
            zmq.CURVE_PUBLICKEY: self.public,
            zmq.CURVE_SECRETKEY: self.secret,
        }


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # 40-character Z85 text, as it appears in the config
    secret: bytes  # 40-character Z85 text


def valid_public_key(text: object) -> bool:
    """True if `text` is a Z85-encoded 32-byte CURVE key (40 characters)."""
    if not isinstance(text, str) or len(text) != 40:
        return False
    try:
        return len(z85.decode(text.encode("ascii"))) == 32
    except (ValueError, KeyError, UnicodeEncodeError):
        return False


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(text)
    os.chmod(path, mode)  # the umask may have taken bits away; never added any


def generate(name: str, directory: str | os.PathLike[str] = ".") -> tuple[Path, Path, KeyPair]:
    """Write NAME.key (0644) and NAME.key_secret (0600) in `directory`; refuse to overwrite."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists():
            raise FileExistsError(f"{path} exists; remove it first if you really mean to replace this key")
    public, secret = zmq.curve_keypair()
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    header = f"#   dpwa CURVE certificate for node {name}, generated {stamp}\n"
    body = f'metadata\n    node = "{name}"\ncurve\n    public-key = "{public.decode()}"\n'
    _write(public_path, header + body, 0o644)
    _write(
        secret_path,
        header + "#   SECRET: keep this file private (mode 0600)\n" + body + f'    secret-key = "{secret.decode()}"\n',
        0o600,
    )
    return public_path, secret_path, KeyPair(public, secret)


def load_secret(path: str | os.PathLike[str], expected_public: str) -> KeyPair:
    """Load a node's key pair from its secret key file, refusing unsafe or mismatched files."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the secret key file: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{path}: the secret key file is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"{path}: the secret key file can be read by others (mode {stat.filemode(st.st_mode)}); "
            f"run: chmod 600 {path}"
        )
    if st.st_uid != os.getuid():
        raise KeyFileError(f"{path}: the secret key file belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: not a CURVE certificate: {exc}") from None
    if not secret:
        raise KeyFileError(f"{path}: holds no secret-key; give the .key_secret file, not the public .key")
    if public.decode() != expected_public:
        raise KeyFileError(
            f"{path}: its public key {public.decode()!r} is not the one the config lists "
            f"for this node ({expected_public!r})"
        )
    return KeyPair(public, secret)
