"""Same-host fast path: snapshot slots in shared-memory files, guarded by flock.

A node with peers on its own machine keeps its snapshot slots in files under
``/dev/shm/dpwa-<uid>/<name>-<port>-<id>/`` (the directory is 0700, the files
0600: no other local user can read or write them). A same-host peer still
asks over ZeroMQ, but the reply names a slot instead of carrying the bytes;
the peer maps that file read-only and blends straight from it.

A slot is never read torn:

* the publisher only writes a slot whose *exclusive* ``flock`` it can take
  without waiting, marks the header invalid (version 0) while writing, and
  writes the new version before unlocking;
* the reader takes a *shared* ``flock`` on the slot, then checks that the
  header holds the version the server announced. If the slot was rewritten
  between the reply and the lock, the versions differ and the reader rejects
  it; once the reader holds the lock, the slot cannot be rewritten.

The kernel drops the locks of a reader that dies, so a crashed peer never
pins a slot for good, and the publisher never waits: a locked slot is skipped.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import numpy as np

from .protocol import ProtocolError

__all__ = ["SharedMemoryError", "SharedSlots", "SlotFile", "PeerSlots", "SharedView", "user_dir"]

HEADER_BYTES = 64
_MAGIC = b"DPWASLT1"
_HEADER = struct.Struct("<8sQQ")  # magic, version (0 while being written), payload bytes


class SharedMemoryError(RuntimeError):
    """Shared memory cannot be used safely here (the message says why)."""


def _root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def user_dir(root: Path | None = None) -> Path:
    """This user's private directory for slot files, created 0700 if missing.

    Refuses a directory that is a symlink, belongs to someone else, or that
    others can open: such a directory could let another user read or swap
    our snapshots.
    """
    path = (root or _root()) / f"dpwa-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SharedMemoryError(f"cannot create {path}: {exc.strerror}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SharedMemoryError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(found uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); remove it or fix it"
        )
    return path


def _node_prefix(name: str, port: int) -> str:
    return f"{name}-{port}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SlotFile:
    """One snapshot slot: a 64-byte header and the payload, in a shared-memory file (owner side)."""

    def __init__(self, path: Path, nbytes: int, dtype: np.dtype) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + nbytes)
            self._map = mmap.mmap(fd, HEADER_BYTES + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._nbytes = nbytes
        self.array = np.frombuffer(self._map, dtype=dtype, offset=HEADER_BYTES, count=nbytes // dtype.itemsize)
        self._write_header(0)

    def _write_header(self, version: int) -> None:
        self._map[:_HEADER.size] = _HEADER.pack(_MAGIC, version, self._nbytes)

    def begin_write(self) -> bool:
        """Take the slot for writing if no reader holds it; never waits."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        self._write_header(0)  # readers that come late see "being written"
        return True

    def end_write(self, version: int) -> None:
        """Publish the slot's new `version` (0 leaves it invalid) and let readers in."""
        self._write_header(version)
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.array = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        os.close(self._fd)


class SharedSlots:
    """The shared-memory slots of one serving node (owner side)."""

    def __init__(self, name: str, port: int, nbytes: int, dtype: np.dtype, root: Path | None = None) -> None:
        base = user_dir(root)
        self._sweep(base)
        self.id = secrets.token_hex(8)  # tells a restarted node's files from its predecessor's
        self.dir = base / f"{_node_prefix(name, port)}{self.id}"
        os.mkdir(self.dir, 0o700)
        (self.dir / "owner").write_text(str(os.getpid()))
        self._nbytes, self._dtype = nbytes, np.dtype(dtype)
        self._files: list[SlotFile] = []

    @staticmethod
    def _sweep(base: Path) -> None:
        """Remove slot directories whose owning process is gone (a node killed with SIGKILL)."""
        for entry in base.iterdir():
            try:
                pid = int((entry / "owner").read_text())
            except (OSError, ValueError):
                continue
            if not _pid_alive(pid):
                shutil.rmtree(entry, ignore_errors=True)

    def allocate(self, index: int) -> SlotFile:
        slot = SlotFile(self.dir / f"slot-{index}", self._nbytes, self._dtype)
        self._files.append(slot)
        return slot

    def close(self) -> None:
        """Unmap and delete every slot file. Readers keep what they mapped until they let go."""
        for slot in self._files:
            slot.close()
        self._files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


class SharedView:
    """A peer's slot, locked for reading: `array` is valid until `release()`."""

    __slots__ = ("array", "_fd")

    def __init__(self, array: np.ndarray, fd: int) -> None:
        self.array = array
        self._fd = fd

    def release(self) -> None:
        """Drop the shared lock (closing the lock's file descriptor). Idempotent."""
        fd, self._fd = self._fd, -1
        self.array = None
        if fd >= 0:
            os.close(fd)


class PeerSlots:
    """Read-only mappings of one same-host peer's slots (reader side)."""

    def __init__(self, peer: str, port: int, root: Path | None = None) -> None:
        self._peer, self._port, self._root = peer, port, root
        self._shm_id: str | None = None
        self._maps: dict[int, mmap.mmap] = {}

    def _path(self, shm_id: str, slot: int) -> Path:
        return user_dir(self._root) / f"{_node_prefix(self._peer, self._port)}{shm_id}" / f"slot-{slot}"

    def acquire(self, shm_id: str, slot: int, version: int, nbytes: int, dtype: np.dtype) -> SharedView:
        """Lock `slot` for reading and check it holds `version`; raise ProtocolError if not."""
        if shm_id != self._shm_id:  # first use, or the peer restarted: its old files are gone
            self.close()
            self._shm_id = shm_id
        path = self._path(shm_id, slot)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ProtocolError("shm_unavailable", f"cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != HEADER_BYTES + nbytes:
                raise ProtocolError("shm_unavailable", f"{path} is not a private slot of {nbytes} bytes")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise ProtocolError("shm_busy", f"{path} is being rewritten") from None
            mapping = self._maps.get(slot)
            if mapping is None:
                mapping = self._maps[slot] = self._map(path, st)
            magic, got_version, got_nbytes = _HEADER.unpack_from(mapping, 0)
            if magic != _MAGIC or got_version != version or got_nbytes != nbytes:
                raise ProtocolError("shm_stale", f"{path} holds version {got_version}, expected {version}")
            array = np.frombuffer(mapping, dtype=dtype, offset=HEADER_BYTES, count=nbytes // dtype.itemsize)
        except BaseException:
            os.close(fd)
            raise
        return SharedView(array, fd)

    @staticmethod
    def _map(path: Path, locked: os.stat_result) -> mmap.mmap:
        """Map `path` read-only through a second open: mmap keeps a duplicate of the
        descriptor it maps, and a duplicate of the locked one would hold the lock for
        as long as the mapping lives."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (locked.st_dev, locked.st_ino):
                raise ProtocolError("shm_unavailable", f"{path} changed while it was being opened")
            return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
        finally:
            os.close(fd)

    def close(self) -> None:
        for mapping in self._maps.values():
            try:
                mapping.close()
            except BufferError:  # a view is still in use; the mapping is freed with it
                pass
        self._maps.clear()
