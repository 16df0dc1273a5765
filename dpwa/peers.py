"""Peer selection with flow control.

The rule, exactly (the README repeats it):

* every peer starts with score 1.0, and its score always stays within
  [SCORE_MIN, SCORE_MAX] = [0.05, 1.0];
* a fetch that succeeds adds 0.25 (additive increase);
* a fetch that times out, fails or is rejected halves the score
  (multiplicative decrease);
* the next peer is ``argmax_i(log(score_i) + G_i)`` where the ``G_i`` are
  independent standard Gumbel draws. This "score plus a random term" picks
  peer i with probability exactly ``score_i / sum_j score_j``.

So a peer that keeps timing out sinks to 0.05 and is picked about 20 times less
often than a healthy one, but never never: it is still tried now and then,
and four successes bring it back to full score. No peer is ever dropped.
"""

from __future__ import annotations

import math
import random
import threading
from typing import Sequence

__all__ = ["PeerSelector", "SCORE_MAX", "SCORE_MIN", "SCORE_STEP_UP", "SCORE_DECAY"]

SCORE_MAX = 1.0
SCORE_MIN = 0.05
SCORE_STEP_UP = 0.25
SCORE_DECAY = 0.5


class PeerSelector:
    """Bounded per-peer scores and a score-weighted random choice. Thread-safe."""

    def __init__(self, peers: Sequence[str], rng: random.Random | None = None) -> None:
        if len(set(peers)) != len(peers):
            raise ValueError(f"peer names must be unique, got {list(peers)!r}")
        self._scores = {name: SCORE_MAX for name in peers}
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._scores)

    def choose(self) -> str | None:
        """A peer drawn with probability proportional to its score; None if there are none."""
        with self._lock:
            best, best_key = None, -math.inf
            for name, score in self._scores.items():
                u = self._rng.random()
                # Gumbel(0, 1) draw; 1 - u lies in (0, 1], so both logs are finite.
                gumbel = -math.log(-math.log(1.0 - u)) if u > 0.0 else -math.inf
                key = math.log(score) + gumbel
                if key > best_key:
                    best, best_key = name, key
            if best is None and self._scores:  # every draw was u == 0: vanishingly rare
                best = self._rng.choice(list(self._scores))
            return best

    def success(self, peer: str) -> None:
        with self._lock:
            self._scores[peer] = min(SCORE_MAX, self._scores[peer] + SCORE_STEP_UP)

    def failure(self, peer: str) -> None:
        with self._lock:
            self._scores[peer] = max(SCORE_MIN, self._scores[peer] * SCORE_DECAY)

    def score(self, peer: str) -> float:
        with self._lock:
            return self._scores[peer]

    def scores(self) -> dict[str, float]:
        with self._lock:
            return dict(self._scores)

    def probabilities(self) -> dict[str, float]:
        """The chance each peer is chosen next."""
        with self._lock:
            total = sum(self._scores.values())
            return {name: score / total for name, score in self._scores.items()}
