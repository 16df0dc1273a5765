"""One back-off for every retry: waits that grow from ``initial_s`` by ``factor`` up to ``cap_s``, optionally
jittered, and start over at ``reset()``.

It holds no clock: a caller that schedules passes the time it read (``fail(now)`` answers when to try next,
``ready(now)`` whether that time has come), so the rules are testable without sleeping. ``Backoffs`` keeps one
per key (a peer), for the retries that are counted per peer.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["Backoff", "Backoffs"]

K = TypeVar("K", bound=Hashable)


class Backoff:
    """The wait after the n-th failure in a row is ``min(cap_s, initial_s * factor ** (n - 1))``, less up to
    ``jitter`` of it at random (0 by default: the waits are exact).

    ``next()`` records a failure and returns its wait; ``fail(now)`` does the same and remembers when to try
    again (``ready(now)``, ``retry_at``); ``reset()`` after a success.
    """

    def __init__(
        self,
        initial_s: float,
        cap_s: float,
        factor: float = 2.0,
        jitter: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 < initial_s <= cap_s:
            raise ValueError(f"Backoff: expected 0 < initial_s <= cap_s, got initial_s={initial_s}, cap_s={cap_s}")
        if factor < 1:
            raise ValueError(f"Backoff: expected factor >= 1, got {factor}")
        if not 0 <= jitter < 1:
            raise ValueError(f"Backoff: expected 0 <= jitter < 1, got {jitter}")
        self.initial_s, self.cap_s, self.factor, self.jitter = initial_s, cap_s, factor, jitter
        self._rng = rng if rng is not None else random.Random()
        self.failures = 0
        self.failed_at = 0.0  # the `now` of the last fail()
        self.retry_at = 0.0

    def after(self, failures: int) -> float:
        """The wait (without jitter) after `failures` failures in a row; 0 after none."""
        if failures <= 0:
            return 0.0
        grown = self.initial_s
        for _ in range(failures - 1):  # at most ~60 rounds before any cap is reached
            grown *= self.factor
            if grown >= self.cap_s:
                return self.cap_s
        return min(self.cap_s, grown)

    def peek(self) -> float:
        """The wait the next failure would bring (without jitter), recording nothing."""
        return self.after(self.failures + 1)

    def next(self) -> float:
        """One more failure: its wait."""
        self.failures += 1
        wait = self.after(self.failures)
        if self.jitter:
            wait -= wait * self.jitter * self._rng.random()
        return wait

    def fail(self, now: float) -> float:
        """One more failure at `now` (kept in ``failed_at``): the time to try again (kept in ``retry_at``)."""
        self.failed_at = now
        self.retry_at = now + self.next()
        return self.retry_at

    def ready(self, now: float) -> bool:
        """Has the wait after the last failure passed (always, after none)?"""
        return now >= self.retry_at

    def reset(self) -> None:
        """A success: the next failure waits ``initial_s`` again."""
        self.failures = 0
        self.failed_at = self.retry_at = 0.0


class Backoffs(Generic[K]):
    """One :class:`Backoff` per key, made on a key's first failure with the same settings."""

    def __init__(self, initial_s: float, cap_s: float, factor: float = 2.0, jitter: float = 0.0) -> None:
        Backoff(initial_s, cap_s, factor, jitter)  # checks the settings once, here
        self._settings = (initial_s, cap_s, factor, jitter)
        self._rng = random.Random()
        self._each: dict[K, Backoff] = {}

    def get(self, key: K) -> Backoff:
        """The key's back-off (a fresh one if it has none)."""
        backoff = self._each.get(key)
        if backoff is None:
            backoff = self._each[key] = Backoff(*self._settings, rng=self._rng)
        return backoff

    def fail(self, key: K, now: float) -> float:
        """One more failure of `key` at `now`: when to try it again."""
        return self.get(key).fail(now)

    def ready(self, key: K, now: float) -> bool:
        backoff = self._each.get(key)
        return backoff is None or backoff.ready(now)

    def failures(self, key: K) -> int:
        backoff = self._each.get(key)
        return 0 if backoff is None else backoff.failures

    def retry_at(self, key: K) -> float:
        backoff = self._each.get(key)
        return 0.0 if backoff is None else backoff.retry_at

    def failed_at(self, key: K) -> float:
        backoff = self._each.get(key)
        return 0.0 if backoff is None else backoff.failed_at

    def reset(self, key: K) -> None:
        self._each.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._each

    def __len__(self) -> int:
        return len(self._each)

    def __iter__(self) -> Iterator[K]:
        """The keys with a back-off (a copy: a caller may forget keys while it iterates)."""
        return iter(list(self._each))
