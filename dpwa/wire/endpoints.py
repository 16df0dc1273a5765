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
    "BindError",
    "EndpointLock",
    "EndpointInUse",
    "PrivateDirError",
    "bind_address",
    "ipc_claimed",
    "ipc_endpoint",
    "is_local_host",
    "is_loopback",
    "private_dir",
    "sweep",
]


LOCK_SUFFIX = ".lock"  # an ipc endpoint's lock file is its socket's path with this added


class PrivateDirError(RuntimeError):
    """This user's private directory cannot be used safely (the message says why)."""


class EndpointInUse(RuntimeError):
    """Another live process holds the endpoint."""


class BindError(ValueError):
    """A bind address that no listener can bind on this machine (the message says why)."""


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


def ipc_claimed(port: int, root: Path | None = None) -> bool:
    """True if the ipc endpoint of 127.0.0.1:`port` has a lock file (:class:`EndpointLock`): a live node
    may listen there while the TCP port itself is free. Creates nothing."""
    return ((root or _root()) / f"dpwa-{os.getuid()}" / f"node-{port}{LOCK_SUFFIX}").exists()


class EndpointLock:
    """An exclusive lock on an ipc endpoint, held until :meth:`close` (or the process dies).

    The lock is an ``flock`` on ``<socket path>.lock``. :meth:`close`, called
    once the socket is closed, removes the socket file and the lock file while
    still holding the lock; files left by a process that died are swept by the
    next one to claim an endpoint in the directory (:func:`sweep`). A lock
    file can be removed while another process has it open, so after locking,
    the holder checks that the path still names the file it locked, and tries
    again if not: at most one live process ever holds an endpoint.

    Raises :class:`EndpointInUse` when another process holds it.
    """

    def __init__(self, endpoint: str) -> None:
        if not endpoint.startswith("ipc://"):
            raise ValueError(f"only ipc endpoints are locked, got {endpoint}")
        self.socket_path = Path(endpoint[len("ipc://") :])
        self.path = self.socket_path.with_name(self.socket_path.name + LOCK_SUFFIX)
        sweep(self.path.parent)
        for _ in range(_LOCK_ATTEMPTS):
            fd = _lock(self.path)
            if fd is None:
                raise EndpointInUse(f"{endpoint} is in use by another process (its lock {self.path} is held)")
            if fd >= 0:
                self._fd: int | None = fd
                return
        raise EndpointInUse(f"{endpoint}: its lock file {self.path} kept being replaced while we locked it")

    def close(self) -> None:
        """Remove the socket and lock files, then release the lock. Idempotent. Call it once the socket is closed."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                self.socket_path.unlink(missing_ok=True)
                self.path.unlink(missing_ok=True)
            finally:
                os.close(fd)

    def __enter__(self) -> EndpointLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LOCK_ATTEMPTS = 8  # a lock file swept between our open and our lock is opened again


def _lock(path: Path) -> int | None:
    """Lock `path` (created if missing): its descriptor; None if another process holds it; -1 if the file
    was removed or replaced before we locked it (try again)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is None or (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)
            return -1
        return fd
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise


def sweep(directory: Path) -> int:
    """Remove the endpoint files (``X`` and ``X.lock``) whose lock nobody holds: left by processes that died.

    Safe against live owners: a file is removed only while its lock is held here. Returns how many
    endpoints were swept.
    """
    swept = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.endswith(".lock"):
            continue
        path = directory / name
        try:
            fd = _lock(path)
        except OSError:
            continue
        if fd is None or fd < 0:
            continue
        try:
            (directory / name[: -len(".lock")]).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            swept += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return swept


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


_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def bind_address(value: str) -> str:
    """The numeric address that every listener of a node binds for `value`, resolved once.

    ``*`` (every interface) and numeric addresses stay as they are. An
    interface name (``lo``, ``eth0``: ZeroMQ binds those, Python's sockets do
    not) becomes its IPv4 address, read from the kernel. Anything else is a
    host name, resolved like ZeroMQ resolves it (IPv4 first). So the node's
    ZeroMQ socket and its bulk listener bind exactly the same address.
    Raises :class:`BindError` naming what was expected.
    """
    text = value.strip()
    if text in ("*", "0.0.0.0", "::"):
        return text
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    names = {name for _, name in socket.if_nameindex()}
    if text in names:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", text.encode()[:15]))
            except OSError as exc:
                raise BindError(
                    f"interface {text!r} has no IPv4 address ({exc.strerror}); give the address to bind instead"
                ) from None
        return socket.inet_ntoa(packed[20:24])
    try:
        infos = socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        known = ", ".join(sorted(names)) or "none"
        raise BindError(
            f"{text!r} is neither an address, '*', an interface of this machine (here: {known}) "
            f"nor a host name that resolves ({exc})"
        ) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as ZeroMQ without ZMQ_IPV6
    return str(infos[0][4][0])
