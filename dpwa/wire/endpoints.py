"""Where services listen: addresses, this user's private directory, and ipc endpoints in it.

A cluster whose every node is on this machine (loopback addresses) and that
has no CURVE keys talks over ZeroMQ ``ipc://`` sockets in this user's private
directory (mode 0700), never over TCP: no other local user can even connect,
so nobody without the user's rights can make a node buffer anything. The
node's port still names its endpoint (``node-<port>``), and a lock file held
for the node's lifetime makes a second node on the same port fail as a TCP
bind would, instead of silently taking the socket over (libzmq unlinks an
existing ipc socket file when it binds).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import stat
import tempfile
from pathlib import Path

__all__ = [
    "EndpointLock",
    "EndpointInUse",
    "PrivateDirError",
    "ipc_endpoint",
    "is_local_host",
    "is_loopback",
    "private_dir",
]


class PrivateDirError(RuntimeError):
    """This user's private directory cannot be used safely (the message says why)."""


class EndpointInUse(RuntimeError):
    """Another live process holds the endpoint."""


def _root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def private_dir(root: Path | None = None) -> Path:
    """This user's private directory (``/dev/shm/dpwa-<uid>``), created 0700 if missing.

    Refuses a directory that is a symlink, belongs to someone else, or that
    others can open: such a directory could let another user read or swap
    our snapshots, or reach our sockets.
    """
    path = (root or _root()) / f"dpwa-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivateDirError(f"cannot create {path}: {exc.strerror}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PrivateDirError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); remove it or fix it"
        )
    return path


def ipc_endpoint(port: int, root: Path | None = None) -> str:
    """The ipc endpoint that stands for 127.0.0.1:`port` in a loopback cluster."""
    return f"ipc://{private_dir(root) / f'node-{port}'}"


class EndpointLock:
    """An exclusive lock on an ipc endpoint, held until :meth:`close` (or the process dies).

    Raises :class:`EndpointInUse` when another process holds it.
    """

    def __init__(self, endpoint: str) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"only ipc endpoints are locked, got {endpoint}")
        self.path = Path(endpoint[len("ipc://") :] + ".lock")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise EndpointInUse(f"{endpoint} is in use by another process (its lock {self.path} is held)") from None
            raise
        self._fd: int | None = fd

    def close(self) -> None:
        """Release the lock. Idempotent. The lock file stays (removing it could race a new owner)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> EndpointLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_loopback(host: str) -> bool:
    """True if every address `host` resolves to is a loopback address (so only this machine reaches it)."""
    if host in ("*", "0.0.0.0", "::", ""):
        return False
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    addresses = {info[4][0] for info in infos}
    try:
        return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)
    except ValueError:
        return False


def is_local_host(host: str) -> bool:
    """True if `host` names this machine: a loopback address, or an address of a local interface."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        try:
            if ipaddress.ip_address(address.split("%")[0]).is_loopback:
                return True
        except ValueError:
            continue
        try:  # an address this machine can bind is one of its own
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False
