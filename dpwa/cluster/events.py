"""A run's event log (RUN_DIR/events.jsonl), and a bounded follower of JSON-lines files.

The launcher writes one JSON object a line to ``RUN_DIR/events.jsonl`` for what
it does and sees; the dashboard (:mod:`.dashboard`) reads it. Every line has
``t`` (Unix time, s), ``kind`` and, for a node's event, ``node``:

* ``{"kind": "run_start", "nodes": [...], "pid": launcher's pid}`` when the launcher starts;
* ``{"kind": "node_start", "node", "pid", "restart": n}`` each time a node's process starts (n = 0 at first);
* ``{"kind": "kill", "node", "pid", "by": "chaos"}`` when chaos mode sends SIGKILL;
* ``{"kind": "exit", "node", "code"}`` when a node's process ends (-9: killed by SIGKILL);
* ``{"kind": "restart", "node", "restart": n, "of": N}`` when the launcher starts a dead node again;
* ``{"kind": "stop", "signal": "SIGINT"}`` when the launcher is told to stop its nodes;
* ``{"kind": "run_end", "code"}`` when the launcher is done.

The file is mode 0600 (:mod:`dpwa.runfiles.private`). It is bounded: after
:data:`MAX_EVENTS` lines the launcher writes one ``{"kind": "truncated"}``
line and no more (a resumed run appends to the same file and counts what is
there).

This module is also where every tool that reads a run folder's JSON-lines
files (the metrics files, ``events.jsonl``) parses them: ``python -m dpwa plot``,
``python -m dpwa status RUN_DIR``, the launcher's live view and the dashboard.
:class:`JsonlFollower` reads a file within bounds and :func:`parse_line`
turns one line into a record, checked by :func:`check_metrics` (or
:func:`check_event`). A line that is too long, not UTF-8, not JSON, not an
object, or whose known fields have the wrong types is skipped and reported as
a :class:`BadLine` (the file, the line number, what is wrong); the readers go
on with the next line and never fail on what a file holds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runfiles.lines import check_event, check_metrics, kind_of
from ..runfiles.private import open_private

__all__ = [
    "EVENTS_FILE",
    "MAX_EVENTS",
    "MAX_LINE_BYTES",
    "MAX_REPORTS",
    "BadLine",
    "EventLog",
    "JsonlFollower",
    "check_event",
    "check_metrics",
    "parse_line",
    "read_jsonl",
]

EVENTS_FILE = "events.jsonl"
MAX_EVENTS = 10_000  # lines an event log holds at most (a chaos run of days writes a few thousand)
MAX_LINE_BYTES = 1 << 20  # a longer line in a followed file is skipped (and reported), not kept
READ_CHUNK_BYTES = 1 << 20  # what one poll reads of one file at most; the rest comes at the next polls
MAX_REPORTS = 10  # bad lines reported one by one per file; later ones are counted only


class EventLog:
    """Appends events to RUN_DIR/events.jsonl, at most `max_events` lines in all. Owned by the launcher.

    A write that fails (a full disk) loses that event, never the run. Use it as
    a context manager, or call :meth:`close`.
    """

    def __init__(self, run_dir: str | Path, max_events: int = MAX_EVENTS) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.max_events = max_events
        self.lost = 0  # events not written: the file is full, or a write failed
        self._written = _count_lines(self.path)
        self._fh = open_private(self.path, "a")  # mode 0600; held open, closed by close()

    def write(self, kind: str, node: str | None = None, **fields: Any) -> None:
        """Append one event (``t`` is now); silently dropped once the file is full."""
        if self._fh.closed:
            return
        if self._written >= self.max_events:
            self.lost += 1
            return
        record: dict[str, Any] = {"t": round(time.time(), 3), "kind": kind}
        if node is not None:
            record["node"] = node
        record.update(fields)
        if self._written == self.max_events - 1:  # the last line says why no more follow
            record = {"t": record["t"], "kind": "truncated", "limit": self.max_events}
        try:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
            self._written += 1
        except OSError:
            self.lost += 1

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError:  # the last flush met a full disk
            pass

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(READ_CHUNK_BYTES), b""))
    except FileNotFoundError:
        return 0


# --------------------------------------------------------------------------- reading JSON-lines files

Check = Callable[[dict[str, Any]], "str | None"]  # a record's fields: None if fine, else what is wrong


@dataclass(frozen=True)
class BadLine:
    """A line of a run-folder file that was skipped: where it is, and what is wrong with it, in words."""

    path: Path
    line: int  # 1 for the first line
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: line {self.line}: {self.reason}; skipped"


def parse_line(raw: bytes, max_line_bytes: int = MAX_LINE_BYTES, check: Check | None = None) -> dict[str, Any] | str:
    """One line of a JSON-lines file (without its newline): the record, or what is wrong with it, in words.

    A line must be at most `max_line_bytes`, UTF-8, one JSON object, and pass `check` (if given).
    A blank line gives ``""`` (nothing to report).
    """
    if len(raw) > max_line_bytes:
        return f"{len(raw)} bytes, longer than the {max_line_bytes} a line may have"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1})"
    if not line.strip():
        return ""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg} (column {exc.colno}); cut short, or not written by dpwa"
    except (ValueError, RecursionError) as exc:  # an integer of 5000 digits, nesting too deep for the parser
        return f"not JSON that can be read: {str(exc)[:80] or type(exc).__name__}"
    if not isinstance(record, dict):
        return f"{kind_of(record)}, not a JSON object"
    problem = check(record) if check is not None else None
    return problem if problem else record


class JsonlFollower:
    """Reads the JSON objects appended to one file since the last call, within bounds.

    Each :meth:`poll` reads at most `chunk_bytes`; a line longer than
    `max_line_bytes` is skipped whole, as is a line that is not UTF-8, not a
    JSON object, or that `check` finds wrong: each is counted in
    :attr:`bad_lines`, and the first `max_reports` of them are reported (as
    :class:`BadLine`, with the line's number) to `report` and kept until
    :meth:`take_problems`. A file that shrank (rewritten) is read again from
    its start. A last line without its newline waits for the rest (see
    :meth:`finish`). Callers still check what they use of a record.
    """

    def __init__(
        self,
        path: str | Path,
        chunk_bytes: int = READ_CHUNK_BYTES,
        max_line_bytes: int = MAX_LINE_BYTES,
        check: Check | None = None,
        max_reports: int = MAX_REPORTS,
    ) -> None:
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.max_line_bytes = max_line_bytes
        self.check = check
        self.max_reports = max_reports
        self.offset = 0
        self.line = 0  # lines read whole so far: the next one is line + 1
        self.bad_lines = 0
        self.at_end = False  # the last poll reached the end of the file
        self._problems: list[BadLine] = []  # reported, not yet taken
        self._reported = 0
        self._partial = b""
        self._skipping = 0  # inside a line that is too long: its bytes so far, dropped up to its end

    def poll(self) -> list[dict[str, Any]]:
        """The complete lines appended since the last call (at most `chunk_bytes` of them), as dicts."""
        try:
            with open(self.path, "rb") as fh:
                size = fh.seek(0, 2)
                if size < self.offset:  # truncated or replaced: start over
                    self.offset, self.line, self._partial, self._skipping, self._reported = 0, 0, b"", 0, 0
                fh.seek(self.offset)
                chunk = fh.read(self.chunk_bytes)
        except OSError:  # not there yet, or unreadable: nothing new
            self.at_end = True
            return []
        self.offset += len(chunk)
        self.at_end = len(chunk) < self.chunk_bytes
        return self._lines(chunk)

    def poll_all(self, max_chunks: int = 64) -> list[dict[str, Any]]:
        """:meth:`poll` until the end of the file, at most `max_chunks` times (the rest comes next time)."""
        records: list[dict[str, Any]] = []
        for _ in range(max_chunks):
            records += self.poll()
            if self.at_end:
                break
        return records

    def finish(self) -> list[dict[str, Any]]:
        """The last line, when it has no newline (a file read once, whole): its record if it is a whole
        one, else it is reported as cut short. Call after :meth:`poll` reached the end."""
        if not self._partial and not self._skipping:
            return []
        self.line += 1
        partial, skipped = self._partial, self._skipping
        self._partial, self._skipping = b"", 0
        if skipped:
            self._bad(
                f"{skipped} bytes and no newline at its end, longer than the {self.max_line_bytes} a line may have"
            )
            return []
        result = parse_line(partial, self.max_line_bytes, self.check)
        if isinstance(result, dict):
            return [result]
        if result:
            self._bad(f"no newline at its end (cut short, or still being written): {result}")
        return []

    def take_problems(self) -> list[BadLine]:
        """The bad lines reported since the last call."""
        problems, self._problems = self._problems, []
        return problems

    def _bad(self, reason: str) -> None:
        self.bad_lines += 1
        if self._reported < self.max_reports:
            self._reported += 1
            if self._reported == self.max_reports:
                reason += f" (the last of {self.max_reports} reported: later bad lines of this file are only counted)"
            self._problems.append(BadLine(self.path, self.line, reason))

    def _lines(self, chunk: bytes) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        *lines, rest = chunk.split(b"\n")
        for i, line in enumerate(lines):
            self.line += 1
            if i == 0:
                skipped, self._skipping = self._skipping, 0
                line, self._partial = self._partial + line, b""
                if skipped:
                    self._bad(f"{skipped + len(line)} bytes, longer than the {self.max_line_bytes} a line may have")
                    continue
            result = parse_line(line, self.max_line_bytes, self.check)
            if isinstance(result, dict):
                records.append(result)
            elif result:
                self._bad(result)
        if self._skipping:
            self._skipping += len(rest)
        else:
            self._partial += rest
            if len(self._partial) > self.max_line_bytes:
                self._partial, self._skipping = b"", len(self._partial)
        return records


def read_jsonl(
    path: str | Path, check: Check | None = None, max_line_bytes: int = MAX_LINE_BYTES
) -> tuple[list[dict[str, Any]], JsonlFollower]:
    """Every record of a JSON-lines file read once, whole (a last line without newline included), and the
    follower that read it (its :attr:`~JsonlFollower.bad_lines`, :meth:`~JsonlFollower.take_problems`).
    Memory: the records, plus one line of at most `max_line_bytes`."""
    follower = JsonlFollower(path, max_line_bytes=max_line_bytes, check=check)
    records: list[dict[str, Any]] = []
    for _ in range(1 << 40):  # bounded by the file's size: each round reads a chunk or ends
        records += follower.poll()
        if follower.at_end:
            break
    return records + follower.finish(), follower
