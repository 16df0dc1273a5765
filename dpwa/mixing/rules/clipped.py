"""clipped: ClippedGossip (He, Karimireddy and Jaggi, 2022), for peers that may send wrong values.

The peer's difference is clipped to a radius tau before it is blended:
``x += f clip(s_peer - s_own, tau)``, with ``clip(d, tau) = d min(1, tau / ||d||)``.
A peer that is far away (a Byzantine one, or one that diverged) moves a node by
at most ``f tau`` per exchange, however far it is.

tau is ``rule_options.radius``: a fixed number, or ``auto``: the median of the
distances this node saw in its last ``window`` exchanges, this one included
(so an outlier among honest distances is clipped to their median; a node's
first exchange is not clipped). In mode symmetric both halves clip the same
difference with the same fixed radius, so the pair's sum, and the nodes'
mean, is kept; ``auto`` is for mode pull only, since each side's history
would give its own radius.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from .. import kernels
from .base import Option, Rule, RuleError, positive_number

AUTO = "auto"


def _radius(value: Any) -> float | str:
    return AUTO if value == AUTO else positive_number(value)


def _window(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
        raise ValueError(f"expected an integer in [1, 1024], got {value!r}")
    return value


class ClippedGossip(Rule):
    name = "clipped"
    summary = "ClippedGossip: `x += f clip(peer - own snapshot, radius)`, robust to peers that send wrong values"
    options = {
        "radius": Option(AUTO, _radius, "the clipping radius tau (> 0), or `auto`: the median of recent distances"),
        "window": Option(16, _window, "with `radius: auto`: how many recent distances the median is taken over"),
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen: deque[float] = deque(maxlen=self.settings["window"])
        self.clipped = 0  # exchanges whose difference was clipped

    @classmethod
    def check_mode(cls, mode: str, settings: dict[str, Any]) -> None:
        if mode == "symmetric" and settings["radius"] == AUTO:
            raise RuleError("rule 'clipped' with radius auto needs mode pull (each side would clip by its own radius)")

    def report(self) -> dict[str, float]:
        return {"clipped": self.clipped}

    def state(self) -> dict[str, Any]:
        """With radius auto: the recent distances, so a joiner clips from its first exchange."""
        return {"seen": list(self._seen)} if self.settings["radius"] == AUTO else {}

    def check_state(self, state: Any) -> Any:
        if self.settings["radius"] != AUTO:
            return super().check_state(state)
        seen = state.get("seen") if isinstance(state, dict) and set(state) == {"seen"} else None
        window = self.settings["window"]
        if not isinstance(seen, list) or len(seen) > window:
            raise ValueError(f"rule 'clipped': state must be {{seen: a list of at most {window} distances}}")
        for d in seen:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < float("inf"):
                raise ValueError(f"rule 'clipped': a distance must be a finite number >= 0, got {d!r}")
        return [float(d) for d in seen]

    def load_state(self, checked: Any) -> None:
        self._seen.clear()
        self._seen.extend(checked)

    def _weight(self, a, b, f, wire) -> float:
        """f, scaled down so that f * ||a - b|| is at most f * tau."""
        d = kernels.distance(a, b, wire)
        tau = self.settings["radius"]
        if tau == AUTO:
            self._seen.append(d)
            tau = statistics.median(self._seen)
        if d <= tau:
            return f
        self.clipped += 1
        return f * tau / d

    def blend(self, params, own, peer, f, wire):
        if own is None:
            raise ValueError("rule clipped needs our own snapshot")
        w = self._weight(peer, own, f, wire)
        params.add_scaled_diff_from(peer, own, w, wire)
        return w

    def mirror(self, params, served, requester, f, wire):
        w = self._weight(requester, served, f, wire)
        params.add_scaled_diff_from(requester, served, w, wire)
        return w


RULE = ClippedGossip
