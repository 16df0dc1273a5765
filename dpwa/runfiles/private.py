"""A run folder is this user's alone: its folders are made mode 0700 and its files 0600, whatever the umask.

Every tool that writes into a run folder (the launcher, its PID files and logs,
the event log, checkpoints, the example's metrics and weights) goes through
these helpers, so another user of the machine can neither read nor write what
is in it, nor open (and so lock) any of its files.

* :func:`make_private_dir` makes a folder (and the folders missing above it)
  with mode 0700 and checks that what is there belongs to this user and is
  not writable by anyone else: a folder of another user, or one that others
  may write to, is a :class:`NotPrivateError` naming it. A folder of this user
  that others may only read or enter is tightened to 0700.
* :func:`open_private` opens a file as :func:`open` does, creating it with
  mode 0600; a file that exists already is set to 0600, and one of another
  user is refused.
* :func:`write_private` writes a whole file atomically (a temporary file in
  the same folder, renamed over it), mode 0600.
* :func:`make_private_file` sets a file some other code wrote (a plot) to 0600.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO, Any

__all__ = [
    "PRIVATE_DIR",
    "PRIVATE_FILE",
    "NotPrivateError",
    "make_private_dir",
    "make_private_file",
    "open_private",
    "write_private",
]

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_MAX_DEPTH = 256  # folders made at once at most: a path deeper than this is surely a mistake


class NotPrivateError(PermissionError):
    """A folder or file of a run that another user owns or may write to; the message names it."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _check_dir(path: Path) -> None:
    """Refuse `path` unless it is a folder of this user that nobody else may write to; tighten it to 0700."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise NotPrivateError(f"{path}: cannot check this folder ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotPrivateError(f"{path}: not a folder")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        raise NotPrivateError(
            f"{path}: this folder belongs to {_owner(st.st_uid)}, not to this user ({_owner(os.geteuid())}); "
            "a run folder must be yours alone: choose another folder"
        )
    if mode & 0o022:
        raise NotPrivateError(
            f"{path}: others may write to this folder (mode {mode:04o}), so someone else may have put files "
            "in it; a run folder must be yours alone: choose another folder, or 'chmod 700' it if you trust "
            "what is in it"
        )
    if mode != PRIVATE_DIR:
        os.chmod(path, PRIVATE_DIR)


def make_private_dir(path: str | os.PathLike[str], base: str | os.PathLike[str] | None = None) -> Path:
    """Make folder `path` with mode 0700 (and every missing folder above it); returns it.

    Checked, and tightened to 0700 if others may read it: `path` itself, every
    folder this call makes, and, when `base` is given, every folder between
    `base` (not included) and `path`. A folder among them that belongs to
    another user, or that others may write to, is a :class:`NotPrivateError`
    naming it, and nothing is made inside it. `base` is where the caller's own
    folders start (a run folder it was given, which is not ours to change).
    """
    path = Path(path)
    root = Path(base) if base is not None and path.is_relative_to(base) else None
    chain: list[Path] = []  # from `path` upwards: what to check, or make and check
    here = path
    for _ in range(_MAX_DEPTH):
        below_base = root is not None and here != root and here.is_relative_to(root)
        if not (here == path or below_base or not os.path.lexists(here)):
            break
        chain.append(here)
        if here.parent == here:
            break
        here = here.parent
    for folder in reversed(chain):  # top down: a folder is checked before anything is made in it
        if not os.path.lexists(folder):
            try:
                os.mkdir(folder, PRIVATE_DIR)
            except FileExistsError:
                pass  # made meanwhile (another node of the run): checked like the others
            else:
                os.chmod(folder, PRIVATE_DIR)  # exactly 0700, whatever the umask took
        _check_dir(folder)
    return path


def _own(fd: int, path: str | os.PathLike[str]) -> None:
    """The file open at `fd` must be this user's; set it to exactly 0600."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise NotPrivateError(
            f"{os.fsdecode(path)}: this file belongs to {_owner(st.st_uid)}, not to this user ({_owner(os.geteuid())})"
        )
    if stat.S_IMODE(st.st_mode) != PRIVATE_FILE:
        os.fchmod(fd, PRIVATE_FILE)


def _opener(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        _own(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(path: str | os.PathLike[str], mode: str = "w", encoding: str | None = None) -> IO[Any]:
    """:func:`open` for a file of a run folder: created with mode 0600, an existing one set to 0600.

    Text modes default to UTF-8. A file that belongs to another user is a
    :class:`NotPrivateError`.
    """
    if "b" not in mode and encoding is None:
        encoding = "utf-8"
    return open(path, mode, encoding=encoding, opener=_opener)  # noqa: SIM115 - the caller closes it


def write_private(path: str | os.PathLike[str], data: bytes | str, fsync: bool = False) -> Path:
    """Write `data` to `path` (mode 0600) atomically: a reader sees the old file or the new one, whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open_private(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def make_private_file(path: str | os.PathLike[str]) -> Path:
    """Set `path`, a file of this user that other code wrote, to mode 0600; returns it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _own(fd, path)
    finally:
        os.close(fd)
    return Path(path)
