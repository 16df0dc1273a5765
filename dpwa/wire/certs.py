"""Member certificates: a cluster key's consent that a node may join, under a name, with a CURVE key. Pure.

Open membership lets a node join a keyed cluster through any known peer, so
each node must decide alone whether a newcomer's key is one the cluster
trusts. An allowlist would have to be edited and copied to every node each
time a machine joins, which is what open membership removes. Instead the
cluster has one Ed25519 key pair (``python -m dpwa keygen --cluster-key --dir
DIR`` writes ``DIR/cluster.pub`` and ``DIR/cluster.secret``). Its public key
goes to every node; its secret key stays with whoever admits machines. A
member's certificate (``python -m dpwa keygen NAME --dir keys --sign-with
DIR/cluster.secret`` writes ``keys/NAME.cert``) says, signed by that key:

* which cluster key signed it (:func:`key_id`: 8 bytes of its SHA-256);
* the member's name (1 to 64 letters, digits, ``_``, ``.``, ``-``, as a
  config's node names and :mod:`dpwa.gossip.membership.view` have them);
* the member's CURVE public key (its 32 bytes; Z85 text, 40 characters, to
  the caller);
* when it was issued and when it expires (``not_after``), in whole unix
  seconds; and the format's version.

:func:`verify` checks a certificate a peer sent against the name and key it
claims, and returns ``"ok"`` or one reason from :data:`REFUSALS`. Nothing a
peer sends raises out of it: a value that is not a string, too long, not
canonical base64url, of the wrong length or version, or with a field out of
range is ``bad_cert``. :class:`Certifier` is the ``trusted(name, key)`` that
:class:`dpwa.gossip.membership.view.View` takes, and counts its refusals by reason.

**What a certificate does not bind: the endpoint.** A certificate travels
with gossip, far from the member it names, and the member's address may
change (DHCP, a restart on another port) without a new signature. It need
not be signed: whoever connects to a member's endpoint checks the CURVE
server key in the handshake, and only the holder of that key's secret can
complete it. So a certificate replayed with another endpoint (by a peer, or
by someone who copied it) only points the cluster at a host that cannot
complete the handshake: every exchange with that entry fails. A replayed
certificate cannot admit another name or another key, nor let anyone but the
key's holder speak as the member. What it can do is keep announcing that name
and key, with any endpoint, until it expires.

**Expiry is the revocation.** There is no revocation list to distribute: a
certificate is refused after ``not_after`` (by the verifier's clock;
a certificate issued up to :data:`CLOCK_SKEW_S` in the verifier's future is
accepted, for clocks that disagree a little). Give short validities (30 days
by default, :data:`MAX_VALID_S` at most) and re-sign (``--renew``) before they
run out; to revoke a member early, change the cluster key and re-sign the others.
A verifier decides when it is asked: a view that admitted a member must ask
again as its certificate expires.

The certificate is one ASCII string of at most :data:`CERT_MAX` characters:
base64url, unpadded, of this layout (integers big-endian), then the 64-byte
Ed25519 signature of the bytes ``dpwa member certificate\\0`` followed by it:

    version (1) | cluster key id (8) | issued_at (8) | not_after (8) | CURVE key (32) | name length (1) | name

So 123 to 186 bytes, 164 to 248 characters.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
import stat
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from zmq.utils import z85

from .curve import KeyFileError, valid_public_key

__all__ = [
    "CERT_MAX",
    "CLOCK_SKEW_S",
    "KEY_RE",
    "MAX_TIME",
    "MAX_VALID_S",
    "NAME_RE",
    "PROBLEMS",
    "REFUSALS",
    "VERSION",
    "Certificate",
    "Certifier",
    "Verdict",
    "decode",
    "generate_cluster_key",
    "key_id",
    "load_cluster_public",
    "load_cluster_secret",
    "read_cert",
    "sign",
    "verify",
    "write_cert",
]

Verdict = Literal[
    "ok",
    "no_cert",  # nothing was given (None): the member has no certificate
    "bad_cert",  # not a str, too long, not canonical base64url, wrong length or version, a field out of range
    "wrong_cluster",  # signed by another cluster key (its key id is not ours)
    "bad_signature",  # claims our cluster key, but the signature does not verify: forged or altered
    "name_mismatch",  # a valid certificate, for another name
    "key_mismatch",  # a valid certificate, for another CURVE key
    "not_yet_valid",  # issued more than CLOCK_SKEW_S in the future
    "expired",  # now is past not_after
]
REFUSALS: Final = (
    "no_cert",
    "bad_cert",
    "wrong_cluster",
    "bad_signature",
    "name_mismatch",
    "key_mismatch",
    "not_yet_valid",
    "expired",
)
PROBLEMS: Final = {  # each refusal, as a sentence for an error message
    "no_cert": "no certificate was given",
    "bad_cert": "it is not a certificate this dpwa reads",
    "wrong_cluster": "another cluster key signed it",
    "bad_signature": "its signature does not verify: it was altered or forged",
    "name_mismatch": "it is for another name",
    "key_mismatch": "it is for another CURVE key",
    "not_yet_valid": "it was issued in the future (check the clocks)",
    "expired": "it expired: renew it (python -m dpwa keygen NAME --sign-with cluster.secret --renew)",
}
VERSION: Final = 1
CERT_MAX: Final = 256  # characters a certificate may have (the longest name gives 248)
CLOCK_SKEW_S: Final = 300  # a certificate issued this far in the verifier's future is still accepted
MAX_VALID_S: Final = 366 * 86400  # the longest validity sign() gives: expiry is the revocation
MAX_TIME: Final = 2**53  # issued_at and not_after beyond this are refused
NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # as dpwa.gossip.membership.view's names
KEY_RE: Final = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")  # as its Z85 CURVE public keys

_CONTEXT = b"dpwa member certificate\0"  # what the signature covers starts with this: it signs nothing else
_HEAD = struct.Struct(">B8sQQ32sB")  # version, cluster key id, issued_at, not_after, CURVE key, name length
_SIGNATURE_BYTES = 64
_B64URL_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_PUBLIC_TAG, _SECRET_TAG = "dpwa-cluster-public", "dpwa-cluster-secret"
_KEY_FILE_MAX = 4096  # bytes a cluster key file may hold: one line, and comments


def key_id(public: Ed25519PublicKey) -> bytes:
    """The cluster key's id, as certificates name it: the first 8 bytes of the SHA-256 of its 32 bytes."""
    return hashlib.sha256(public.public_bytes_raw()).digest()[:8]


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Certificate:
    """A member certificate's fields, as :func:`decode` reads them (and :func:`sign` writes them)."""

    cluster_id: bytes  # the signing cluster key's id (key_id), 8 bytes
    name: str  # the member's name
    curve_public: str  # the member's CURVE public key, Z85 (40 characters)
    issued_at: int  # unix seconds
    not_after: int  # unix seconds: not accepted after this
    signature: bytes = b""  # 64 bytes of Ed25519 over signed_bytes()
    version: int = VERSION

    def body(self) -> bytes:
        """The fields in the certificate's byte layout (without the signature)."""
        name = self.name.encode("ascii")
        key = z85.decode(self.curve_public.encode("ascii"))
        head = _HEAD.pack(self.version, self.cluster_id, self.issued_at, self.not_after, key, len(name))
        return head + name

    def signed_bytes(self) -> bytes:
        """What the signature covers: a fixed context string, then the body."""
        return _CONTEXT + self.body()

    def encode(self) -> str:
        """The certificate as one string: base64url of the body and the signature, unpadded."""
        return base64.urlsafe_b64encode(self.body() + self.signature).rstrip(b"=").decode("ascii")


def decode(cert: object) -> Certificate:
    """The fields of a certificate string, every one checked (signature not verified); ValueError saying what
    is wrong otherwise. Only ValueError escapes, whatever `cert` is."""
    if not isinstance(cert, str):
        raise ValueError(f"a certificate must be a string, got {type(cert).__name__}")
    if not 0 < len(cert) <= CERT_MAX:
        raise ValueError(f"a certificate must have 1 to {CERT_MAX} characters, got {len(cert)}")
    if not _B64URL_RE.fullmatch(cert) or len(cert) % 4 == 1:
        raise ValueError("a certificate must be unpadded base64url (A-Z a-z 0-9 - _)")
    try:
        raw = base64.urlsafe_b64decode(cert + "=" * (-len(cert) % 4))
    except ValueError:  # binascii.Error is one
        raise ValueError("a certificate must be unpadded base64url (A-Z a-z 0-9 - _)") from None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != cert:
        raise ValueError("a certificate's base64url is not canonical (stray bits in its last character)")
    if len(raw) < _HEAD.size + 1 + _SIGNATURE_BYTES:
        raise ValueError(f"a certificate has at least {_HEAD.size + 1 + _SIGNATURE_BYTES} bytes, got {len(raw)}")
    version, cluster_id, issued_at, not_after, key, name_length = _HEAD.unpack_from(raw)
    if version != VERSION:
        raise ValueError(f"certificate version {version}; this dpwa reads version {VERSION}")
    if len(raw) != _HEAD.size + name_length + _SIGNATURE_BYTES:
        raise ValueError(f"a certificate with a {name_length}-byte name has {_HEAD.size + name_length + 64} bytes")
    name = raw[_HEAD.size : _HEAD.size + name_length].decode("ascii", errors="replace")
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"a certificate's name must be 1 to 64 letters, digits, '_', '.', '-', got {name!r}")
    if not issued_at <= not_after <= MAX_TIME:
        raise ValueError(
            f"a certificate's times must have issued_at <= not_after <= 2**53, got {issued_at}, {not_after}"
        )
    return Certificate(
        cluster_id=cluster_id,
        name=name,
        curve_public=z85.encode(key).decode("ascii"),
        issued_at=issued_at,
        not_after=not_after,
        signature=raw[-_SIGNATURE_BYTES:],
        version=version,
    )


def sign(secret: Ed25519PrivateKey, name: str, curve_public: str, valid_s: int, *, now: float | None = None) -> str:
    """A certificate for member `name` with CURVE public key `curve_public` (Z85), valid for `valid_s` seconds
    from `now` (default: the time now), signed by the cluster key `secret`. ValueError naming a bad argument."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(f"name must be 1 to 64 letters, digits, '_', '.', '-', got {name!r:.80}")
    if not isinstance(curve_public, str) or not KEY_RE.fullmatch(curve_public) or not valid_public_key(curve_public):
        raise ValueError(f"curve_public must be a 40-character Z85 CURVE public key, got {curve_public!r:.80}")
    if not isinstance(valid_s, int) or isinstance(valid_s, bool) or not 0 < valid_s <= MAX_VALID_S:
        raise ValueError(f"valid_s must be a whole number of seconds in [1, {MAX_VALID_S}] (366 days), got {valid_s!r}")
    issued_at = int(time.time() if now is None else now)
    if not 0 <= issued_at <= MAX_TIME - valid_s:
        raise ValueError(f"now must be unix seconds in [0, 2**53 - valid_s], got {now!r}")
    fields = Certificate(key_id(secret.public_key()), name, curve_public, issued_at, issued_at + valid_s)
    return replace(fields, signature=secret.sign(fields.signed_bytes())).encode()


def verify(cluster_public: Ed25519PublicKey, cert: object, name: object, key: object, now: float) -> Verdict:
    """Does `cert` let member `name` join with CURVE key `key` (Z85) at `now` (unix seconds)?

    ``"ok"``, or the first reason it fails, in this order: ``no_cert`` (None), ``bad_cert``,
    ``wrong_cluster``, ``bad_signature``, ``name_mismatch``, ``key_mismatch``, ``not_yet_valid``,
    ``expired``. Never raises, whatever the certificate, name and key are.
    """
    if cert is None:
        return "no_cert"
    try:
        fields = decode(cert)
    except ValueError:
        return "bad_cert"
    if fields.cluster_id != key_id(cluster_public):
        return "wrong_cluster"
    try:
        cluster_public.verify(fields.signature, fields.signed_bytes())
    except InvalidSignature:
        return "bad_signature"
    if fields.name != name:
        return "name_mismatch"
    if fields.curve_public != key:
        return "key_mismatch"
    if fields.issued_at > now + CLOCK_SKEW_S:
        return "not_yet_valid"
    if now > fields.not_after:
        return "expired"
    return "ok"


class Certifier:
    """A keyed cluster's consent, as :class:`dpwa.gossip.membership.view.View` asks it: ``trusted(name, key, cert)``.

    Args:
        cluster_public: the cluster's public key (:func:`load_cluster_public`).
        clock: unix seconds now (``time.time``; a test gives its own).

    Each refusal is counted by its reason in :attr:`refused` (:meth:`stats` for a node's ``stats()``).
    """

    def __init__(
        self,
        cluster_public: Ed25519PublicKey,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cluster_public, self._clock = cluster_public, clock
        self.refused: Counter[str] = Counter()  # certificates refused, by reason

    def check(self, name: object, key: object, cert: object) -> Verdict:
        """:func:`verify` now, counting a refusal by its reason."""
        verdict = verify(self.cluster_public, cert, name, key, self._clock())
        if verdict != "ok":
            self.refused[verdict] += 1
        return verdict

    def __call__(self, name: str, key: str | None, cert: object) -> bool:
        """May member `name` join with `key`? Only with `cert`, a valid certificate for both."""
        return self.check(name, key, cert) == "ok"

    def order(self, cert: object) -> tuple[int, int] | None:
        """A certificate's (issued_at, not_after), to keep the newer of two; None if it cannot be read."""
        try:
            c = decode(cert)
        except ValueError:
            return None
        return c.issued_at, c.not_after

    def not_after(self, cert: object) -> int | None:
        """When a certificate stops being valid (unix seconds), or None if it cannot be read."""
        try:
            return decode(cert).not_after
        except ValueError:
            return None

    def stats(self) -> dict[str, int]:
        """The refusals so far, as ``certs_refused.REASON`` counts."""
        return {f"certs_refused.{reason}": count for reason, count in sorted(self.refused.items())}


# --------------------------------------------------------------------------- files


def _write_new(path: Path, text: str, mode: int, *, replace: bool = False) -> None:
    """Write `path` with exactly `mode`, atomically (a reader sees no file or the whole one). Unless `replace`,
    an existing file is never replaced: FileExistsError, even if it appeared meanwhile."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            os.fchmod(fh.fileno(), mode)  # exactly `mode`, whatever the umask took
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if `path` exists: nothing is ever overwritten
            except FileExistsError:
                raise FileExistsError(f"{path} exists; remove it first if you really mean to replace it") from None
    finally:
        tmp.unlink(missing_ok=True)


def generate_cluster_key(directory: str | os.PathLike[str], name: str = "cluster") -> tuple[Path, Path]:
    """Write a new cluster key pair, NAME.pub (0644) and NAME.secret (0600), in `directory`; return their paths.

    Each file is written atomically with exactly its mode, whatever the umask; an existing file is never
    replaced (FileExistsError naming it).
    """
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"name must be 1 to 64 letters, digits, '_', '.', '-', got {name!r:.80}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = directory / f"{name}.pub", directory / f"{name}.secret"
    for path in (public_path, secret_path):
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists; remove it first if you really mean to replace this cluster key")
    secret = Ed25519PrivateKey.generate()
    public = secret.public_key()
    ident = key_id(public).hex()
    secret_text = base64.b64encode(secret.private_bytes_raw()).decode("ascii")
    public_text = base64.b64encode(public.public_bytes_raw()).decode("ascii")
    _write_new(
        secret_path,
        f"# dpwa cluster secret key {ident}: it signs member certificates (python -m dpwa keygen NAME "
        "--sign-with THIS_FILE). Keep it private (mode 0600), on the machine that admits nodes only.\n"
        f"{_SECRET_TAG} {secret_text}\n",
        0o600,
    )
    _write_new(public_path, f"{_PUBLIC_TAG} {public_text}\n", 0o644)
    return public_path, secret_path


def _key_line(path: Path, data: bytes, tag: str, what: str) -> bytes:
    """The 32 key bytes of a cluster key file's one line, ``TAG BASE64``; KeyFileError naming the file."""
    expected = f"one line '{tag} BASE64' (32 bytes in base64, as python -m dpwa keygen --cluster-key writes)"
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not a cluster {what} key file: expected {expected}, got non-ASCII bytes") from None
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if tag == _PUBLIC_TAG and len(lines) == 1 and lines[0].startswith(_SECRET_TAG):
        raise KeyFileError(f"{path}: this is the cluster's secret key; give its public key file (NAME.pub)")
    if tag == _SECRET_TAG and len(lines) == 1 and lines[0].startswith(_PUBLIC_TAG):
        raise KeyFileError(f"{path}: this is the cluster's public key; give its secret key file (NAME.secret)")
    parts = lines[0].split() if len(lines) == 1 else []
    if len(parts) != 2 or parts[0] != tag:
        raise KeyFileError(f"{path}: not a cluster {what} key file: expected {expected}")
    try:
        key = base64.b64decode(parts[1], validate=True)
    except ValueError:  # binascii.Error is one
        key = b""
    if len(key) != 32:
        raise KeyFileError(f"{path}: the {what} key is not 32 bytes in base64: expected {expected}")
    return key


def _read_key_file(path: Path, what: str) -> tuple[bytes, os.stat_result]:
    """A cluster key file's bytes (a regular file of at most _KEY_FILE_MAX bytes), and its stat."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO put there does not block us
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the cluster {what} key file: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"{path}: the cluster {what} key file is not a regular file")
        data = b""
        while len(data) <= _KEY_FILE_MAX:
            chunk = os.read(fd, _KEY_FILE_MAX + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) > _KEY_FILE_MAX:
        raise KeyFileError(
            f"{path}: a cluster {what} key file holds one short line, this one over {_KEY_FILE_MAX} bytes"
        )
    return data, st


def load_cluster_public(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """The cluster public key in `path` (NAME.pub); KeyFileError naming the file and what was expected."""
    path = Path(path)
    data, _ = _read_key_file(path, "public")
    return Ed25519PublicKey.from_public_bytes(_key_line(path, data, _PUBLIC_TAG, "public"))


def load_cluster_secret(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """The cluster secret key in `path` (NAME.secret), refusing a file that group or others may read, or that
    belongs to another user; KeyFileError naming the file and what was expected."""
    path = Path(path)
    data, st = _read_key_file(path, "secret")
    raw = _key_line(path, data, _SECRET_TAG, "secret")  # first: the public file given by mistake is named so
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"{path}: the cluster secret key file can be read by others (mode {stat.filemode(st.st_mode)}); "
            f"run: chmod 600 {path}"
        )
    if st.st_uid != os.geteuid():
        raise KeyFileError(
            f"{path}: the cluster secret key file belongs to uid {st.st_uid}, not to this user ({os.geteuid()})"
        )
    return Ed25519PrivateKey.from_private_bytes(raw)


def read_cert(path: str | os.PathLike[str]) -> str:
    """The certificate in `path` (as :func:`write_cert` writes it: one line); KeyFileError naming the file and
    what is wrong."""
    path = Path(path)
    data, _ = _read_key_file(path, "certificate")
    try:
        text = data.decode("ascii").strip()
        decode(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise KeyFileError(
            f"{path}: not a member certificate (python -m dpwa keygen NAME --sign-with cluster.secret writes "
            f"keys/NAME.cert): {exc}"
        ) from None
    return text


def write_cert(path: str | os.PathLike[str], cert: str, *, replace: bool = False) -> Path:
    """Write certificate `cert` to `path` (one line, mode 0644) atomically. An existing file is replaced only
    with `replace` (a renewal); FileExistsError otherwise."""
    decode(cert)  # a ValueError if it is not a certificate: never write one that cannot be read back
    path = Path(path)
    _write_new(path, cert + "\n", 0o644, replace=replace)
    return path
