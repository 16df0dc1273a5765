"""Thread-safe counters shared by a node's threads."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["Counters"]


class Counters:
    """Named integer counters and last-value gauges, safe to update from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._gauges: dict[str, Any] = {}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._gauges[key] = value

    def get(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def snapshot(self) -> dict[str, Any]:
        """A copy of every counter and gauge."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out.update(self._gauges)
            return out
