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

**What a ramp cannot ratchet** (issue 41). The median follows the distances
the attack itself creates: honest nodes pushed apart by clipped steps of a
peer that moves a little further each time lengthen their distances to one
another, so the median, and the next clipped step, grow together. After 400
steps of such a ramp the honest nodes had moved 1.5e8 along it. So ``auto``
anchors itself: the median of its first full window of distances (above 0)
is the *anchor*, kept for the run (a joiner takes its donor's, a checkpoint
keeps it), and the radius never exceeds :data:`CAP` times the anchor. A peer
then moves a node by at most ``f x CAP x anchor`` per exchange, whatever it
sends. The price: if honest distances grow to more than CAP times what they
were over the first window (a learning-rate warm-up, say), honest exchanges
are clipped too (``rule.clipped`` counts them) and mixing slows; set a fixed
radius there.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from .. import kernels
from .base import Option, Rule, RuleError, positive_number

AUTO = "auto"
CAP = 8.0  # with radius auto: the radius is at most this many times the anchor (its first full window's median)


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
        "radius": Option(
            AUTO,
            _radius,
            "the clipping radius tau (> 0), or `auto`: the median of recent distances, at most 8 times the median "
            "of the first full window",
        ),
        "window": Option(16, _window, "with `radius: auto`: how many recent distances the median is taken over"),
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen: deque[float] = deque(maxlen=self.settings["window"])
        self._anchor: float | None = None  # with radius auto: the first full window's median (above 0)
        self.clipped = 0  # exchanges whose difference was clipped

    @classmethod
    def check_mode(cls, mode: str, settings: dict[str, Any]) -> None:
        if mode == "symmetric" and settings["radius"] == AUTO:
            raise RuleError("rule 'clipped' with radius auto needs mode pull (each side would clip by its own radius)")

    def report(self) -> dict[str, float]:
        return {"clipped": self.clipped}

    def state(self) -> dict[str, Any]:
        """With radius auto: the recent distances, so a joiner clips from its first exchange, and the anchor
        once there is one."""
        if self.settings["radius"] != AUTO:
            return {}
        return {"seen": list(self._seen), **({"anchor": self._anchor} if self._anchor is not None else {})}

    def check_state(self, state: Any) -> Any:
        if self.settings["radius"] != AUTO:
            return super().check_state(state)
        fields = set(state) if isinstance(state, dict) else None
        seen = state.get("seen") if fields in ({"seen"}, {"seen", "anchor"}) else None
        window = self.settings["window"]
        if not isinstance(seen, list) or len(seen) > window:
            raise ValueError(
                f"rule 'clipped': state must be {{seen: a list of at most {window} distances, and anchor: a "
                "distance > 0 once there is one}"
            )
        for d in seen:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < float("inf"):
                raise ValueError(f"rule 'clipped': a distance must be a finite number >= 0, got {d!r}")
        anchor = state.get("anchor")
        if anchor is not None and (
            isinstance(anchor, bool) or not isinstance(anchor, (int, float)) or not 0 < anchor < float("inf")
        ):
            raise ValueError(f"rule 'clipped': the anchor must be a finite distance > 0, got {anchor!r}")
        return [float(d) for d in seen], None if anchor is None else float(anchor)

    def load_state(self, checked: Any) -> None:
        seen, anchor = checked
        self._seen.clear()
        self._seen.extend(seen)
        self._anchor = anchor

    def _weight(self, a, b, f, wire) -> float:
        """f, scaled down so that f * ||a - b|| is at most f * tau."""
        d = kernels.distance(a, b, wire)
        tau = self.settings["radius"]
        if tau == AUTO:
            self._seen.append(d)
            tau = statistics.median(self._seen)
            if self._anchor is None and len(self._seen) == self._seen.maxlen and tau > 0:
                self._anchor = tau
            if self._anchor is not None:
                tau = min(tau, CAP * self._anchor)
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
