"""Flow control: which peer to ask next, and when to stop asking every step.

The rule, exactly (docs/configuration.md repeats it):

* every peer starts with score 1.0, and its score always stays within
  [SCORE_MIN, SCORE_MAX] = [0.05, 1.0];
* an exchange (mode pull: a fetch) that succeeds adds 0.25 (additive increase);
* one that times out, fails or is rejected halves the score
  (multiplicative decrease);
* the next peer is ``argmax_i(log(score_i) + G_i)`` where the ``G_i`` are
  independent standard Gumbel draws. This "score plus a random term" picks
  peer i with probability exactly ``score_i / sum_j score_j``.

So a peer that keeps timing out sinks to 0.05 and is picked about 20 times less
often than a healthy one, but never never: it is still tried now and then,
and four successes bring it back to full score. No peer is ever dropped.

:class:`FlowControl` adds the rest of the decision, and is owned by the
training thread: the coin that decides whether a step starts an exchange
(``fetch_probability``), and back-offs. A
peer that missed its last :data:`UNREACHABLE_AFTER` requests (timeouts or
transport failures; any reply, even a refusal, shows a peer is alive) is
*unreachable*: it is not asked for ``timeout``, then twice that after its
next miss, up to :data:`ALONE_BACKOFF_MAX_S`, so a dead peer costs a timeout
now and then, not one in every few steps. When every peer is unreachable
the node says so once, trains alone, and probes one peer after ``timeout``,
then twice that, up to every :data:`ALONE_BACKOFF_MAX_S`, until one answers;
a peer whose request reaches us meanwhile is probed at the next step.

**Rest the dead, not the slow.** A timeout counts as a miss only when the
peer gave no sign of life while the request was out: no reply to any of our
requests, and no request of its own reached our Rx thread
(:class:`SignsOfLife`, fed by both). A peer that answers late, or whose
reply was cut while it kept asking us, is slow: its score halves (it is
asked less), and its next deadline is longer
(:mod:`dpwa.gossip.membership.deadlines`), but it is never rested for it. A resting
peer that asks us is not resting any more.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable, Sequence

from ...backoff import Backoff, Backoffs
from ...logs import logger
from .deadlines import Deadlines

__all__ = [
    "ALONE_BACKOFF_MAX_S",
    "FlowControl",
    "PROVEN_FIRST",
    "PeerSelector",
    "SignsOfLife",
    "SCORE_DECAY",
    "SCORE_MAX",
    "SCORE_MIN",
    "SCORE_STEP_UP",
    "UNREACHABLE_AFTER",
]

SCORE_MAX = 1.0
SCORE_MIN = 0.05
SCORE_STEP_UP = 0.25
SCORE_DECAY = 0.5
UNREACHABLE_AFTER = 2  # consecutive timeouts or transport failures that make a peer count as unreachable
# The share of steps whose first ask goes to a proven peer (one that completed an exchange with us), when there
# are any: members that only answer `busy`, however many an attacker adds to the view, get the rest at most, so
# they cost a node at most that share of its averaging rate (issue 41: 1,000 such fakes cut it to 6%).
PROVEN_FIRST = 0.5
# A rested peer is asked again, and a node whose every peer rests probes one, at most this long after the last
# try (the interval doubles from the timeout up to it). A few seconds, not tens: on a link whose delays straddle
# the deadline, honest peers miss twice in a row now and then, and a node must not go silent for long while a
# peer answers at all. A dead peer then costs one timeout in every few seconds.
ALONE_BACKOFF_MAX_S = 4.0


class PeerSelector:
    """Bounded per-peer scores and a score-weighted random choice. Thread-safe."""

    def __init__(self, peers: Sequence[str], rng: random.Random | None = None) -> None:
        if len(set(peers)) != len(peers):
            raise ValueError(f"peer names must be unique, got {list(peers)!r}")
        self._scores = {name: SCORE_MAX for name in peers}
        self._proven: set[str] = set()  # peers that completed an exchange with us (success)
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._scores)

    def choose(self, exclude: frozenset[str] = frozenset()) -> str | None:
        """A peer (not in `exclude`) drawn with probability proportional to its score; None if there is none."""
        with self._lock:
            best, best_key = None, -math.inf
            candidates = [(n, s) for n, s in self._scores.items() if n not in exclude]
            for name, score in candidates:
                u = self._rng.random()
                # Gumbel(0, 1) draw; 1 - u lies in (0, 1], so both logs are finite.
                gumbel = -math.log(-math.log(1.0 - u)) if u > 0.0 else -math.inf
                key = math.log(score) + gumbel
                if key > best_key:
                    best, best_key = name, key
            if best is None and candidates:  # every draw was u == 0: vanishingly rare
                best = self._rng.choice(candidates)[0]
            return best

    def ranked(self, exclude: frozenset[str] = frozenset()) -> list[str]:
        """Every peer (not in `exclude`), in a random order weighted by score: the first is
        distributed exactly as :meth:`choose`, the rest as choosing again without it. In a share
        PROVEN_FIRST of the calls the proven peers (those that completed an exchange with us) come first,
        each group in that order, so peers that never complete one cannot take every step."""
        with self._lock:
            keyed = []
            for name, score in self._scores.items():
                if name in exclude:
                    continue
                u = self._rng.random()
                gumbel = -math.log(-math.log(1.0 - u)) if u > 0.0 else -math.inf
                keyed.append((math.log(score) + gumbel, name))
            first = self._proven if self._proven and self._rng.random() < PROVEN_FIRST else frozenset()
            return [name for _, _, name in sorted(((n in first, k, n) for k, n in keyed), reverse=True)]

    def add(self, peer: str) -> None:
        """A new peer, at full score (open membership: a member that joined the view)."""
        with self._lock:
            self._scores.setdefault(peer, SCORE_MAX)

    def remove(self, peer: str) -> None:
        """A peer that left (open membership: removed from the view)."""
        with self._lock:
            self._scores.pop(peer, None)
            self._proven.discard(peer)

    def success(self, peer: str) -> None:
        with self._lock:
            if peer in self._scores:  # a peer removed meanwhile is not scored
                self._scores[peer] = min(SCORE_MAX, self._scores[peer] + SCORE_STEP_UP)
                self._proven.add(peer)

    def failure(self, peer: str) -> None:
        with self._lock:
            if peer in self._scores:
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


class SignsOfLife:
    """When each peer last showed it was alive: a reply to one of our requests, or a request of its own.
    Thread-safe: the Rx thread reports requests, the training thread replies. Bounded: it keeps at most
    `max_peers` names (open membership: members come and go; the oldest go first)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_peers: int = 4096) -> None:
        self._clock, self._max = clock, max_peers
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def heard(self, peer: str) -> None:
        now = self._clock()
        with self._lock:
            self._last.pop(peer, None)  # re-inserted last: the dict stays in order of last sign
            self._last[peer] = now
            while len(self._last) > self._max:
                del self._last[next(iter(self._last))]

    def last(self, peer: str) -> float | None:
        """When `peer` last showed a sign of life (this object's clock); None if it never did (or was forgotten)."""
        with self._lock:
            return self._last.get(peer)

    def since(self, peer: str, at: float) -> bool:
        """Did `peer` show a sign of life at or after `at` (a time of this object's clock)?"""
        with self._lock:
            return self._last.get(peer, -math.inf) >= at


class FlowControl:
    """The training thread's choice of whom to ask, from the outcomes of earlier requests.

    Args:
        name: this node, for log messages.
        peers: the peers' names.
        fetch_probability: the chance that a step asks anyone.
        timeout_s: one request's deadline (the first back-off interval), and the floor of the deadlines that
            follow each peer's link (:attr:`deadlines`).
        rng: randomness for the coin and the choice.
        schedule: round -> (the scheduled partner, whether this node starts the exchange)
            (pairing: hypercube); None: a random peer by score.
        clock: the time source (tests pass a fake one).
        on_heard: told of every peer that answered anything (open membership: it is alive, whatever it said).
        deadline_cap_s: the most a deadline that follows a peer's link may grow to (None: CAP_FACTOR times
            `timeout_s`; open membership gives less: see dpwa.gossip.node).

    Its :attr:`signs` (:class:`SignsOfLife`) are told of replies here, and of requests by the Rx thread: a
    timeout of a peer heard from while the request was out is not a miss.
    """

    def __init__(
        self,
        name: str,
        peers: Sequence[str],
        fetch_probability: float,
        timeout_s: float,
        rng: random.Random,
        schedule: Callable[[int], tuple[str, bool]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_heard: Callable[[str], None] = lambda peer: None,
        deadline_cap_s: float | None = None,
    ) -> None:
        self.name = name
        self.signs = SignsOfLife(clock)
        self.slow = 0  # timeouts and failures of peers that showed a sign of life meanwhile (not misses)
        self._schedule = schedule
        self._clock, self._on_heard = clock, on_heard
        self.rounds = 0  # steps that asked whom to ask
        self.selector = PeerSelector(peers, rng=rng)
        self.deadlines = Deadlines(timeout_s, deadline_cap_s)  # each peer's next deadline, from past request times
        self._p, self._timeout_s, self._rng = fetch_probability, timeout_s, rng
        self._misses = {peer: 0 for peer in peers}  # consecutive timeouts or transport failures
        # an unreachable peer rests for the timeout, then twice that after each further miss, up to the maximum;
        # while alone, the probes are as far apart (none: reachable; each back-off's times are clock()'s)
        first_s = min(timeout_s, ALONE_BACKOFF_MAX_S)
        self._rest: Backoffs[str] = Backoffs(first_s, ALONE_BACKOFF_MAX_S)
        self.alone = False  # every peer is unreachable, and we said so once
        self._probes = Backoff(first_s, ALONE_BACKOFF_MAX_S)  # while alone: the interval between probes
        self._next_probe = 0.0  # while alone: time.monotonic() of the next attempt
        self._probed_at = 0.0  # while alone: when we went alone, or last probed
        self.skipped_alone = 0  # steps that did not ask because we were backing off

    def choose(self, exclude: frozenset[str] = frozenset()) -> str | None:
        """The peer to ask this step, or None (no peers, the coin said no, or backing off)."""
        if not self._asks():
            return None
        return self.selector.choose(exclude | self._resting())

    def candidates(self, exclude: frozenset[str] = frozenset()) -> list[str]:
        """The peers to ask this step, best first (see PeerSelector.ranked); empty when none is to be asked.

        With a schedule (pairing: hypercube) only this round's partner, when it is this node's turn. When the
        partner cannot be asked (unreachable, resting, or excluded), a peer by score instead: a dead node costs
        its partners nothing but the schedule."""
        round_, self.rounds = self.rounds, self.rounds + 1
        if not self._asks():
            return []
        blocked = exclude | self._resting()
        if self._schedule is not None:
            partner, ours = self._schedule(round_)
            if partner not in blocked and partner not in self.unreachable():
                return [partner] if ours else []
        return self.selector.ranked(blocked)

    def _resting(self) -> frozenset[str]:
        """Unreachable peers whose back-off has not run out (none while alone: then every peer may be probed)."""
        if self.alone:
            return frozenset()
        now = self._clock()
        return frozenset(
            peer
            for peer in self._rest
            if not self._rest.ready(peer, now)
            and not self.signs.since(peer, self._rest.failed_at(peer))  # it asked us since: alive
        )

    def unreachable(self) -> list[str]:
        """The peers that missed their last UNREACHABLE_AFTER requests."""
        return [peer for peer, misses in self._misses.items() if misses >= UNREACHABLE_AFTER]

    def _asks(self) -> bool:
        """The coin, and the back-off while alone: does this step ask anyone?"""
        if not self._misses or self._rng.random() >= self._p:
            return False
        if self.alone:
            now = self._clock()
            if now < self._next_probe and not any(self.signs.since(peer, self._probed_at) for peer in self._misses):
                self.skipped_alone += 1
                return False
            self._next_probe, self._probed_at = now + self._probes.next(), now
        return True

    def peers(self) -> list[str]:
        """The peers asked, in the order they came."""
        return list(self._misses)

    def add_peer(self, peer: str) -> None:
        """(Open membership) A member joined: a peer like any other, at full score, reachable."""
        if peer == self.name or peer in self._misses:
            return
        self.selector.add(peer)
        self._misses[peer] = 0
        self._rest.reset(peer)

    def remove_peer(self, peer: str) -> None:
        """(Open membership) A member was removed: it is asked no more. Outcomes of its requests still in
        flight are ignored."""
        self.selector.remove(peer)
        self.deadlines.forget(peer)
        self._misses.pop(peer, None)
        self._rest.reset(peer)

    def heard(self, peer: str) -> None:
        """The peer answered something (not a request of ours that scores it): it is alive."""
        self._on_heard(peer)
        self.signs.heard(peer)
        if peer not in self._misses:  # removed meanwhile (open membership)
            return
        self._misses[peer] = 0
        self._rest.reset(peer)
        if self.alone:
            self.alone = False
            self._probes.reset()
            logger.warning("%s: %s answered: averaging again", self.name, peer)

    def record(self, peer: str, outcome: str, refusal: str = "", started: float | None = None) -> None:
        """Learn from one request's outcome (see dpwa.wire.calls for the outcomes); `started`: when the
        request went out (the flow's clock), so that a peer heard from since is counted slow, not missing."""
        if outcome in ("cancelled", "expired") or peer not in self._misses:  # nothing learned, or no peer now
            return
        if outcome in ("timeout", "failed") and started is not None and self.signs.since(peer, started):
            self.slow += 1  # alive, only slow (or its reply was cut): asked less, never rested for it
            self.selector.failure(peer)
            return
        if outcome in ("timeout", "failed"):
            self._misses[peer] += 1
            if self._misses[peer] >= UNREACHABLE_AFTER:  # rest it: timeout, then twice that, ... up to the maximum
                self._rest.fail(peer, self._clock())
        else:  # any reply, even a refusal, shows the peer is alive
            self.heard(peer)
        if outcome == "ok":
            self.selector.success(peer)
            return
        if outcome == "refused" and refusal in ("busy", "aborted", "closing", "not_ready"):
            return  # a healthy peer with its hands full: neither a success nor a failure
        self.selector.failure(peer)
        if not self.alone and all(m >= UNREACHABLE_AFTER for m in self._misses.values()):
            self.alone = True
            self._next_probe = self._probed_at = self._clock() + self._timeout_s
            logger.warning(
                "%s: none of the %d peers answered its last %d requests; training alone, "
                "and trying a peer now and then (at most every %.0f s) until one answers",
                self.name,
                len(self._misses),
                UNREACHABLE_AFTER,
                ALONE_BACKOFF_MAX_S,
            )
