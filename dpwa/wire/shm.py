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
A slot a reader holds for too long is *retired*: its file is unlinked (the
reader keeps what it mapped) and a new file takes its place.

Slot files are allocated for real (``posix_fallocate``), never sparse: a full
``/dev/shm`` (Docker's default is 64 MB) fails the allocation with ENOSPC,
which the caller turns into a heap slot, instead of killing the process with
SIGBUS at the first write past the capacity.

Each node's directory holds an ``owner`` file locked for the node's lifetime.
A node starting on this machine removes the directories whose lock nobody
holds (nodes killed with SIGKILL): a lock, unlike a PID, is seen across PID
namespaces.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import shutil
import struct
from pathlib import Path

import numpy as np

from .endpoints import PrivateDirError, private_dir
from .errors import ProtocolError

__all__ = ["SharedMemoryError", "SharedSlots", "SlotFile", "PeerSlots", "SharedView"]

HEADER_BYTES = 64
_MAGIC = b"DPWASLT1"
_HEADER = struct.Struct("<8sQQ")  # magic, version (0 while being written), payload bytes


class SharedMemoryError(RuntimeError):
    """Shared memory cannot be used here (the message says why)."""


def _node_prefix(name: str, port: int) -> str:
    return f"{name}-{port}-"


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding `path`'s exclusive lock, or None if someone else holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class SlotFile:
    """One snapshot slot: a 64-byte header and the payload, in a shared-memory file (owner side).

    Raises OSError (ENOSPC on a full /dev/shm) if the memory cannot be allocated.
    """

    shared = True  # same-host peers can read it in place

    def __init__(self, path: Path, nbytes: int, dtype: np.dtype) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, HEADER_BYTES + nbytes)  # real pages now, or ENOSPC now: never SIGBUS later
            self._map = mmap.mmap(fd, HEADER_BYTES + nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd = fd
        self._nbytes = nbytes
        self.array: np.ndarray = np.frombuffer(
            self._map, dtype=dtype, offset=HEADER_BYTES, count=nbytes // dtype.itemsize
        )
        self._write_header(0)

    def _write_header(self, version: int) -> None:
        self._map[: _HEADER.size] = _HEADER.pack(_MAGIC, version, self._nbytes)

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
        """Unmap (once nothing in this process still uses the memory) and close. The file stays."""
        if self._fd < 0:
            return
        self.array = np.empty(0, dtype=self.array.dtype)
        try:
            self._map.close()
        except BufferError:  # a view is still alive (a reply being sent); the mapping goes with it
            pass
        os.close(self._fd)
        self._fd = -1

    def retire(self) -> None:
        """Remove the file and let go of it: readers that hold it keep their mapping."""
        self.path.unlink(missing_ok=True)
        self.close()


class SharedSlots:
    """The shared-memory slots of one serving node (owner side).

    Raises SharedMemoryError when the private directory cannot be used.
    """

    def __init__(self, name: str, port: int, nbytes: int, dtype: np.dtype, root: Path | None = None) -> None:
        try:
            base = private_dir(root)
        except PrivateDirError as exc:
            raise SharedMemoryError(str(exc)) from None
        self._sweep(base)
        self.id = secrets.token_hex(8)  # tells a restarted node's files from its predecessor's
        self.dir = base / f"{_node_prefix(name, port)}{self.id}"
        os.mkdir(self.dir, 0o700)
        # The owner lock is taken before the file gets its name, so a sweeper never sees it unlocked.
        tmp = self.dir / "owner.tmp"
        self._owner = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._owner, fcntl.LOCK_EX)
        os.write(self._owner, str(os.getpid()).encode())
        os.rename(tmp, self.dir / "owner")
        self._nbytes, self._dtype = nbytes, np.dtype(dtype)
        self._files: list[SlotFile] = []

    @staticmethod
    def _sweep(base: Path) -> None:
        """Remove slot directories whose owner is gone (a node killed with SIGKILL)."""
        for entry in base.iterdir():
            if not entry.is_dir() or entry.is_symlink():
                continue
            fd = _try_lock(entry / "owner")
            if fd is None:  # alive, or not a node's directory
                continue
            try:
                shutil.rmtree(entry, ignore_errors=True)
            finally:
                os.close(fd)

    def allocate(self, index: int) -> SlotFile:
        """A new slot file for slot `index` (replacing a retired one). OSError if it cannot be allocated."""
        path = self.dir / f"slot-{index}"
        path.unlink(missing_ok=True)
        slot = SlotFile(path, self._nbytes, self._dtype)
        self._files.append(slot)
        return slot

    def close(self) -> None:
        """Unmap and delete every slot file. Readers keep what they mapped until they let go."""
        for slot in self._files:
            slot.close()
        self._files.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._owner)


class SharedView:
    """A peer's slot, locked for reading: `array` is valid until `release()`."""

    __slots__ = ("array", "_fd")

    def __init__(self, array: np.ndarray, fd: int) -> None:
        self.array = array
        self._fd = fd

    def release(self) -> None:
        """Drop the shared lock (closing the lock's file descriptor). Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class PeerSlots:
    """Read-only mappings of one same-host peer's slots (reader side)."""

    def __init__(self, peer: str, port: int, root: Path | None = None) -> None:
        self._peer, self._port, self._root = peer, port, root
        self._shm_id: str | None = None
        self._dir: Path | None = None  # the peer's slot directory for _shm_id, checked once
        self._paths: dict[int, str] = {}  # slot -> its file's path (slots are numbered below 1024)
        self._maps: dict[int, tuple[tuple[int, int], mmap.mmap]] = {}  # slot -> ((dev, inode), mapping)

    def _path(self, shm_id: str, slot: int) -> str:
        # Our private directory is checked (ours, 0700, not a link) on first use only: no other user can
        # replace it afterwards, and each slot file is checked again when it is opened. Four system calls
        # per fetch fewer, each of which let the other threads take the GIL from the training thread.
        path = self._paths.get(slot)
        if path is None:
            if self._dir is None:
                self._dir = private_dir(self._root) / f"{_node_prefix(self._peer, self._port)}{shm_id}"
            path = self._paths[slot] = str(self._dir / f"slot-{slot}")
        return path

    def acquire(self, shm_id: str, slot: int, version: int, nbytes: int, dtype: np.dtype) -> SharedView:
        """Lock `slot` for reading and check it holds `version`; raise ProtocolError if not."""
        if shm_id != self._shm_id:  # first use, or the peer restarted: its old files are gone
            self.close()
            self._shm_id, self._dir = shm_id, None
            self._paths.clear()
        try:
            path = self._path(shm_id, slot)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (OSError, PrivateDirError) as exc:
            raise ProtocolError("shm_unavailable", f"cannot open slot {slot} of {self._peer}: {exc}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size != HEADER_BYTES + nbytes:
                raise ProtocolError("shm_unavailable", f"{path} is not a private slot of {nbytes} bytes")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise ProtocolError("shm_busy", f"{path} is being rewritten") from None
            mapping = self._mapping(path, slot, st)
            magic, got_version, got_nbytes = _HEADER.unpack_from(mapping, 0)
            if magic != _MAGIC or got_version != version or got_nbytes != nbytes:
                raise ProtocolError("shm_stale", f"{path} holds version {got_version}, expected {version}")
            array = np.frombuffer(mapping, dtype=dtype, offset=HEADER_BYTES, count=nbytes // dtype.itemsize)
        except BaseException:
            os.close(fd)
            raise
        return SharedView(array, fd)

    def _mapping(self, path: str, slot: int, locked: os.stat_result) -> mmap.mmap:
        """The mapping of the file we hold locked: cached, unless the slot's file was replaced."""
        inode = (locked.st_dev, locked.st_ino)
        cached = self._maps.get(slot)
        if cached is not None and cached[0] == inode:
            return cached[1]
        if cached is not None:
            _close_map(cached[1])
        # Map through a second open: mmap keeps a duplicate of the descriptor it maps,
        # and a duplicate of the locked one would hold the lock as long as the mapping lives.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != inode:
                raise ProtocolError("shm_stale", f"{path} was replaced while it was being opened")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, st.st_size, flags, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[slot] = (inode, mapping)
        return mapping

    def close(self) -> None:
        for _, mapping in self._maps.values():
            _close_map(mapping)
        self._maps.clear()


def _close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view is still in use; the mapping is freed with it
        pass
