"""Thread-safe counters shared by a node's threads."""

from __future__ import annotations

import threading
from collections import Counter, deque
from typing import Any

__all__ = ["Counters", "Rate"]


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


class Rate:
    """Events per second over the last `window_s`, from a running total sampled now and then. Thread-safe."""

    def __init__(self, window_s: float = 10.0) -> None:
        self._window_s = window_s
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, float]] = deque()

    def sample(self, now: float, total: float) -> None:
        """Record the running total at time `now` (at most one sample a tenth of the window)."""
        with self._lock:
            if self._samples and now - self._samples[-1][0] < self._window_s / 10:
                return
            self._samples.append((now, total))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self._window_s:
                self._samples.popleft()

    def per_second(self, now: float, total: float) -> float:
        with self._lock:
            if not self._samples:
                return 0.0
            start, first = self._samples[0]
        return max(0.0, (total - first) / (now - start)) if now > start else 0.0
