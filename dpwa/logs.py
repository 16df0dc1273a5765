"""Logging helpers: every message goes through ``logging.getLogger("dpwa")``."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

__all__ = ["logger", "RateLimitedLog"]

logger = logging.getLogger("dpwa")


class RateLimitedLog:
    """Log a message at most once per `interval_s` for each key, counting the rest.

    A peer that fails every step, or a flood of bad messages, must not flood
    the log: the first occurrence is logged at once, later ones within the
    interval are counted and reported with the next one that gets through.
    At most `max_keys` keys are remembered (the oldest are forgotten), so
    keys chosen by a peer cannot grow it without bound.
    """

    def __init__(self, log: logging.Logger = logger, interval_s: float = 10.0, max_keys: int = 256) -> None:
        self._log = log
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._last: OrderedDict[object, tuple[float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, level: int, key: object, msg: str, *args: object) -> bool:
        """Log `msg % args` unless `key` was logged less than interval_s ago. True if logged."""
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (-float("inf"), 0))
            if now - last < self._interval_s:
                self._last[key] = (last, suppressed + 1)
                return False
            self._last[key] = (now, 0)
            self._last.move_to_end(key)
            while len(self._last) > self._max_keys:
                self._last.popitem(last=False)
        if suppressed:
            msg = msg + " (%d similar messages suppressed)"
            args = args + (suppressed,)
        self._log.log(level, msg, *args)
        return True
