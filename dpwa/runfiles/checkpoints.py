"""Coordinated checkpoints: one file per node per epoch, a manifest with their hashes, safe loading.

Layout::

    RUN_DIR/checkpoints/epoch-K/NODE.pt        one node's state after epoch K
    RUN_DIR/checkpoints/epoch-K/manifest.json  {"epoch": K, "files": {NODE: {"file", "sha256", "bytes", "saved"}}}
    RUN_DIR/checkpoints/last/NODE.pt           a node's state when it was stopped (SIGTERM) mid-epoch
    RUN_DIR/checkpoints/last/manifest.json

Every file is written atomically: into a temporary file, flushed and
fsync'ed, then renamed over its name (and the directory fsync'ed), so a crash
at any moment leaves the old file or the new one, never half of one. The
manifest is updated the same way under a file lock, one entry per node.
A write that fails (a full disk, a quota) raises :class:`CheckpointError`
naming the file and leaves no partial file and no listing behind: earlier
checkpoints stay complete and loadable.

The folders are made mode 0700 and every file, the lock included, 0600,
whatever the umask (:mod:`dpwa.runfiles.private`): another user of the machine can
neither read a node's state nor open the lock file. The lock is taken with a
deadline (:data:`LOCK_TIMEOUT_S`): a lock held past it, by a process that hung
or one that is not ours, is a :class:`CheckpointError` naming the lock file
and its holder (from ``/proc/locks``), never a wait without end.

An epoch's checkpoint is *complete* when every node's file is listed and
present; :func:`latest_complete` finds the newest. A manifest is checked
whole before any of it is used (:func:`manifest`): every entry names a node,
its file is exactly that node's plain file name in the manifest's folder
(never a path that leads elsewhere), its hash, size and time have their
types. A manifest that fails is a :class:`CheckpointError` naming it, the
entry and what was expected, and nothing it lists is read or deleted. :func:`load` checks a
file's SHA-256 against the manifest before reading it, and reads it with
``torch.load(weights_only=True)``: tensors, numbers, strings, lists, tuples
and dicts only, never arbitrary pickled objects.

What goes into a node's state is the caller's choice (the example saves the
model, the optimizer, the learning-rate schedule, dpwa's clock and barrier
counters, the epoch and step, and the random number generators' states).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..backoff import Backoff
from .private import make_private_dir, open_private

__all__ = [
    "LAST",
    "LOCK_TIMEOUT_S",
    "CheckpointError",
    "checkpoint_dir",
    "discard",
    "epochs",
    "has",
    "latest_complete",
    "load",
    "manifest",
    "save",
]

_EPOCH_DIR = re.compile(r"^epoch-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or damaged; the message names the file."""


class _LockTimeout(CheckpointError):
    """A manifest's lock was held past the deadline."""


LAST = "last"  # the epoch argument for the state a node saves when it is stopped
LOCK_TIMEOUT_S = 10.0  # how long save() and discard() wait for a manifest's lock (others hold it for milliseconds)


def checkpoint_dir(run_dir: str | os.PathLike[str], epoch: int | str) -> Path:
    return Path(run_dir) / "checkpoints" / (LAST if epoch == LAST else f"epoch-{epoch}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp, "wb") as fh:  # mode 0600
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _lock_holder(fd: int) -> str:
    """Who holds the flock on the file open at `fd`, in words, from /proc/locks ('' if it cannot be told)."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read(1 << 20).splitlines()
    except OSError:
        return ""
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line has "->" after the number
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == device and fields[4].isdigit():
            pid = int(fields[4])
            if pid == os.getpid():
                continue
            try:
                command = Path(f"/proc/{pid}/comm").read_text().strip()
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                return f"pid {pid}"
            return f"pid {pid} ({command}, uid {uid})"
    return ""


@contextlib.contextmanager
def _locked(directory: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the folder's manifest.lock (mode 0600) for the block; a CheckpointError after `timeout_s`."""
    path = directory / "manifest.lock"
    with open_private(path, "ab") as fh:
        fd = fh.fileno()
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(0.001, 0.1)
        while True:  # bounded by the deadline
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    holder = _lock_holder(fd)
                    raise _LockTimeout(
                        f"{path}: still locked after {timeout_s:g} s"
                        + (f", by {holder}" if holder else " (the holder is not listed in /proc/locks)")
                    ) from None
                time.sleep(min(backoff.next(), left))
        yield  # closing the file releases the lock


def save(
    run_dir: str | os.PathLike[str],
    epoch: int | str,
    node: str,
    state: dict[str, Any],
    *,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> Path:
    """Write `node`'s state for `epoch` (or LAST) atomically and list it in its manifest. Returns the file.

    The folders are made mode 0700, the files 0600. A CheckpointError names the
    file when it cannot be written, or the lock when it is held past `lock_timeout_s`;
    then nothing new is listed and the node's file is removed.
    """
    import io

    import torch

    if epoch != LAST and (not isinstance(epoch, int) or epoch < 0):
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", node):
        raise ValueError(f"a node name is 1 to 64 letters, digits, '_', '.' or '-', got {node!r}")
    directory = checkpoint_dir(run_dir, epoch)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    path = directory / f"{node}.pt"
    try:
        make_private_dir(directory, base=run_dir)  # checkpoints/ and epoch-K/: 0700, this user's
        _write_atomically(path, data)
    except OSError as exc:  # ENOSPC, EDQUOT, EIO: the temporary file is gone, nothing was listed
        raise CheckpointError(
            f"{path}: could not be written ({exc.strerror or exc}); {node}'s earlier checkpoints are untouched"
        ) from exc
    entry = {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "saved": time.time()}
    manifest_path = directory / "manifest.json"
    try:
        with _locked(directory, lock_timeout_s):
            current = manifest(run_dir, epoch)
            current.setdefault("files", {})[node] = entry
            current["epoch"] = epoch
            _write_atomically(manifest_path, (json.dumps(current, indent=2) + "\n").encode())
    except _LockTimeout as exc:  # not listed, so not part of any checkpoint: removed, as below
        path.unlink(missing_ok=True)
        raise CheckpointError(
            f"{exc}; so {path.name} was not listed and was removed; {node}'s earlier checkpoints are untouched"
        ) from None
    except OSError as exc:
        # Not listed, so not part of any complete checkpoint: remove it rather than leave it to fill the disk.
        path.unlink(missing_ok=True)
        raise CheckpointError(
            f"{manifest_path}: could not be written ({exc.strerror or exc}), so {path.name} "
            f"was removed; {node}'s earlier checkpoints are untouched"
        ) from exc
    return path


_NODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def manifest(run_dir: str | os.PathLike[str], epoch: int | str) -> dict[str, Any]:
    """The manifest of `epoch` ({} when there is none yet), checked whole (CheckpointError if it is off)."""
    path = checkpoint_dir(run_dir, epoch) / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable manifest: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files", {}), dict):
        raise CheckpointError(f"{path}: not a checkpoint manifest (a map with a map of 'files')")
    for node, entry in data.get("files", {}).items():
        problem = _entry_problem(node, entry)
        if problem:
            raise CheckpointError(f"{path}: files[{node!r:.80}]: {problem}")
    return data


def _entry_problem(node: Any, entry: Any) -> str:
    """What is wrong with one manifest entry ('' if nothing): what save() writes, and nothing else."""
    if not (isinstance(node, str) and _NODE.fullmatch(node)):
        return "a node name is 1 to 64 letters, digits, '_', '.' or '-'"
    if not isinstance(entry, dict):
        return f"expected a map with file, sha256, bytes and saved, got {type(entry).__name__}"
    if entry.get("file") != f"{node}.pt":
        return f"'file' must be {node + '.pt'!r}, the node's own file in this folder, got {entry.get('file')!r:.80}"
    if not (isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])):
        return "'sha256' must be 64 lowercase hex digits"
    size = entry.get("bytes")
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
        return f"'bytes' must be an integer >= 0, got {size!r:.40}"
    saved = entry.get("saved")
    if not (isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)):
        return f"'saved' must be a time in seconds, got {saved!r:.40}"
    return ""


def epochs(run_dir: str | os.PathLike[str]) -> list[int]:
    """The epochs that have a checkpoint folder, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _EPOCH_DIR.match(p.name)) and p.is_dir())


def latest_complete(run_dir: str | os.PathLike[str], nodes: Iterable[str]) -> int | str | None:
    """The freshest complete checkpoint of `nodes`: LAST when every one of them saved its state when it
    was stopped (that comes after its epochs'), else the newest epoch with every node's file, else None."""
    names = list(nodes)
    if names and all(has(run_dir, LAST, name) for name in names):
        return LAST
    for epoch in reversed(epochs(run_dir)):
        try:
            files = manifest(run_dir, epoch).get("files", {})
        except CheckpointError:
            continue
        directory = checkpoint_dir(run_dir, epoch)
        if all(name in files and (directory / files[name]["file"]).is_file() for name in names):  # checked names
            return epoch
    return None


def discard(
    run_dir: str | os.PathLike[str], epoch: int | str, node: str, *, lock_timeout_s: float = LOCK_TIMEOUT_S
) -> None:
    """Forget `node`'s state for `epoch` (its LAST state, once it was taken up: it is stale from then on).

    A CheckpointError names the lock when it is held past `lock_timeout_s` (then nothing is changed).
    """
    directory = checkpoint_dir(run_dir, epoch)
    if not directory.is_dir():
        return
    with _locked(directory, lock_timeout_s):
        current = manifest(run_dir, epoch)
        entry = current.get("files", {}).pop(node, None)
        if entry is None:
            return
        _write_atomically(directory / "manifest.json", (json.dumps(current, indent=2) + "\n").encode())
    (directory / entry["file"]).unlink(missing_ok=True)  # the manifest was checked: NODE.pt in this folder


def has(run_dir: str | os.PathLike[str], epoch: int | str, node: str) -> bool:
    """True if `node` has a state listed and present for `epoch` (or LAST)."""
    try:
        entry = manifest(run_dir, epoch).get("files", {}).get(node)
    except CheckpointError:
        return False
    return entry is not None and (checkpoint_dir(run_dir, epoch) / entry["file"]).is_file()


def load(run_dir: str | os.PathLike[str], epoch: int | str, node: str, map_location: Any = "cpu") -> dict[str, Any]:
    """`node`'s state for `epoch`, after checking its hash against the manifest (weights_only loading)."""
    import io

    import torch

    entry = manifest(run_dir, epoch).get("files", {}).get(node)
    directory = checkpoint_dir(run_dir, epoch)
    if entry is None:
        raise CheckpointError(f"{directory / 'manifest.json'}: no checkpoint of {node} for epoch {epoch}")
    path = directory / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"{path}: the checkpoint file the manifest lists is missing")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{path}: its SHA-256 does not match the manifest (damaged or replaced)")
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError and others for what it refuses
        raise CheckpointError(f"{path}: not a safe checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: a checkpoint holds a dict, got {type(state).__name__}")
    return state
