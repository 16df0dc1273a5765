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

The file is bounded: after :data:`MAX_EVENTS` lines the launcher writes one
``{"kind": "truncated"}`` line and no more (a resumed run appends to the same file
and counts what is there).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

__all__ = ["EVENTS_FILE", "MAX_EVENTS", "EventLog", "JsonlFollower"]

EVENTS_FILE = "events.jsonl"
MAX_EVENTS = 10_000  # lines an event log holds at most (a chaos run of days writes a few thousand)
MAX_LINE_BYTES = 64 * 1024  # a longer line in a followed file is skipped, not kept
READ_CHUNK_BYTES = 1 << 20  # what one poll reads of one file at most; the rest comes at the next polls


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
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (held open; closed by close())

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


class JsonlFollower:
    """Reads the JSON objects appended to one file since the last call, within bounds.

    Each :meth:`poll` reads at most `chunk_bytes`; a line longer than
    `max_line_bytes` is skipped whole (counted in :attr:`bad_lines`), as is a
    line that is not a JSON object. A file that shrank (rewritten) is read again
    from its start. Nothing read is trusted: callers check every field.
    """

    def __init__(
        self, path: str | Path, chunk_bytes: int = READ_CHUNK_BYTES, max_line_bytes: int = MAX_LINE_BYTES
    ) -> None:
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
        self.max_line_bytes = max_line_bytes
        self.offset = 0
        self.bad_lines = 0
        self._partial = b""
        self._skipping = False  # inside a line that is too long: drop bytes up to its end

    def poll(self) -> list[dict[str, Any]]:
        """The complete lines appended since the last call (at most `chunk_bytes` of them), as dicts."""
        try:
            with open(self.path, "rb") as fh:
                size = fh.seek(0, 2)
                if size < self.offset:  # truncated or replaced: start over
                    self.offset, self._partial, self._skipping = 0, b"", False
                fh.seek(self.offset)
                chunk = fh.read(self.chunk_bytes)
        except OSError:  # not there yet, or unreadable: nothing new
            return []
        self.offset += len(chunk)
        return self._lines(chunk)

    def _lines(self, chunk: bytes) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        *lines, rest = chunk.split(b"\n")
        for i, line in enumerate(lines):
            if i == 0:
                if self._skipping:
                    self._skipping = False
                    continue
                line = self._partial + line
            if len(line) > self.max_line_bytes:
                self.bad_lines += 1
                continue
            try:
                record = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                self.bad_lines += 1
        if lines:
            self._partial = b""
        if not self._skipping:
            self._partial += rest
            if len(self._partial) > self.max_line_bytes:
                self.bad_lines += 1
                self._partial, self._skipping = b"", True
        return records
