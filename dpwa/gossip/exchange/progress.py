"""The training thread's own numbers: its clock, its last loss, the time a step takes, its blend rate.

Only the training thread writes them (in ``update_send``, ``update_wait`` and
the blends they apply); the Rx thread reads them for status, and each read of
a float is atomic.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ...stats import Rate
from ..transfer.protocol import MAX_CLOCK, MAX_LOSS

__all__ = ["Progress", "clamp_clock", "loss_value"]


def clamp_clock(clock: float) -> float:
    return min(max(clock, 0.0), MAX_CLOCK)


def loss_value(loss: Any) -> float | None:
    """A reported loss as a float within ±MAX_LOSS (what the wire carries), or None if unknown (None, NaN, Inf)."""
    if loss is None:
        return None
    try:
        value = float(loss.item() if hasattr(loss, "item") else loss)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"loss must be a number, a 0-d tensor or None, got {type(loss).__name__}") from exc
    return min(max(value, -MAX_LOSS), MAX_LOSS) if math.isfinite(value) else None


class Progress:
    """Where the training thread is: clock (samples or batches, blended with peers'), last loss, step time."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.loss: float | None = None  # the last loss reported
        self.step_s = 0.0  # a running estimate of the time between two update_send calls
        self.started = time.monotonic()
        self.rate = Rate()  # blends per second, for status
        self._last_send = 0.0

    def sent(self, now: float) -> None:
        """An update_send at `now`: learn the step time."""
        if self._last_send:
            gap = now - self._last_send
            self.step_s = 0.8 * self.step_s + 0.2 * gap if self.step_s else gap
        self._last_send = now

    def set_clock(self, clock: float) -> None:
        self.clock = clamp_clock(clock)
