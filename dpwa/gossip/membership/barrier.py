"""Named barriers without a master: every node counts its own calls and tells its peers.

``node.barrier("epoch")``: the k-th call with a name returns once every node
of the cluster has made its k-th call with that name (or a later one).

Each node keeps its own counters (name -> calls made) and what it last heard
of every peer's. Arriving at a barrier, a node asks every peer with one
``barrier`` request that carries its own counters (so the request also tells
the peer it arrived) and is answered with the peer's counters and with what
the peer knows of the asker's (so a node that restarts learns its own counters
back from its peers). Peers not yet there are asked again with back-off
(10 ms doubling to 1 s), each request within ``timeout_ms``; the node keeps
serving meanwhile (the Rx thread answers snapshot and barrier requests), and
the waiting thread keeps applying settled exchanges.

A node that has closed or died never arrives. After ``timeout_s`` the call
raises :class:`BarrierTimeout` naming the missing nodes and their last known
counters, or, with ``missing="proceed"``, logs who was skipped and returns
their names. In a fixed cluster a peer that showed a sign of life once (a
reply to any request, a request of its own) and then none for
:func:`dead_peer_s` of a wait (four request deadlines, at least 10 s) is dead: once
every peer still behind is, the call ends then, as at ``timeout_s`` (issue
49: the peer of a node that died waited out a 300 s barrier). A peer that
never answered, one still starting, is waited for the whole ``timeout_s``.

**What an arrival can claim.** Counts are integers in [0, :data:`MAX_COUNT`]
on the wire and in memory; a node refuses a call that would count past it.
What a peer says of its counts is believed only up to one call past this
node's own count plus :data:`SLACK`: a barrier compares a peer's count with
this node's own call number, so nothing true is lost, and a forged or buggy
``2**40`` moves the peer's recorded count by two calls at most, not for ever.
A request from a name that is not a peer of the config counts for nothing.
Counts a joining node takes from its donor are bounded by what the cluster
reports (:func:`plausible`).

**Open membership** (a config with ``bootstrap:``; issue 32). "Every node" is
every member of this node's view *now*
(:class:`~dpwa.gossip.membership.members.Members`), re-read at each poll round; a
fixed cluster's barriers count the config's nodes as above. Each node
judges by its own view, which gossip makes the same everywhere in time:

* *A member joins while others wait*: once it is in a waiting node's view
  it is waited for, and it must make its k-th call. A joiner takes its
  donor's counts without the call the donor waits at
  (:meth:`BarrierCounts.offered`), so its next call is that k-th one, and
  the barrier completes when it makes it. (A joiner with ``join: never``
  starts at 0: its first calls return at once, as the others are further
  on, and the others wait until it has made as many calls as they have.)
* *A member leaves while others wait* (closed, killed, cut off): it is
  still waited for, and asked, while it is suspect; once it is removed from
  the view (``suspect_after_ms`` + ``dead_after_ms`` of silence) it is not
  waited for, and the barrier completes without it, without a timeout.
  ``timeout_s`` still bounds the whole wait.
* *A removed member comes back* (a restart, a healed partition: newer news
  of it) is a member again, and is waited for again, from the counts it
  reports then.
* A request from a name the view holds counts, whether the config lists it
  or not; one from a name we do not know may introduce itself (its own
  entry first in its digest, an announcement: rate-limited, within
  ``members_max``), as a fetch's sender may; any other counts for nothing.
  What we heard of a name that left the view is forgotten: the table holds
  at most ``members_max`` names.
* *A member that never takes part* (issue 41: a ghost that answers every
  barrier poll and never arrives) costs a barrier one suspicion period at
  most: once the only members still behind are ones this node never blended
  with (an exchange with it, in either direction, or a fetch from it) that
  answered its polls without having arrived, and that has lasted
  ``suspect_after_ms``, the barrier goes on without them and returns their
  names (a member that does not answer is waited for until it leaves the
  view, as above). Those that have been members for ``suspect_after_ms`` +
  ``dead_after_ms`` (as long as a dead member takes to leave) are retired
  from the view (:meth:`~dpwa.gossip.membership.members.Members.retire`: removed as dead
  ones are, and kept out for the tombstone's time unless they restart; not
  named, as a removed member is not). Before, such a member was admitted,
  cost every barrier its whole ``timeout_s``, and stayed. A member this node
  exchanged with is waited for as long as it is in the view, however slow;
  a newcomer, or a slow starter at a first barrier before any exchange,
  costs one suspicion period and is named.
* While a node waits, nobody exchanges, so barrier requests and replies
  carry digests, and every member (arrived or not) is asked again at most
  ``suspect_after_ms / 3`` (and 1 s) after its last answer: members waiting
  together keep hearing of each other, and news of joiners keeps spreading.

:class:`BarrierCounts` is pure bookkeeping; :class:`BarrierServer` answers the
requests (Rx thread); :class:`BarrierTask` asks one peer (Tx thread).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ...backoff import Backoffs
from ...logs import logger
from ...wire.calls import Ask, Call
from ...wire.errors import ProtocolError
from ...wire.schema import NAME_PATTERN, Integer, ListOf, MapOf, Text, encode, message_kind
from ...wire.server import Reply, Request, Route
from .messages import DIGEST_HEADER_BYTES, ENTRY
from .view import DIGEST_MAX

if TYPE_CHECKING:
    from .members import Members

__all__ = [
    "BARRIER",
    "BARRIER_STATE",
    "COUNTS",
    "MAX_BARRIERS",
    "MAX_COUNT",
    "SLACK",
    "BarrierCounts",
    "BarrierServer",
    "BarrierTask",
    "BarrierTimeout",
    "BarrierWaiter",
    "dead_peer_s",
    "plausible",
]

MAX_BARRIERS = 16  # barrier names one node may use
MAX_COUNT = 2**31 - 1  # calls of one barrier name, at most: the wire's bound, and memory's
SLACK = 1  # a peer's count is believed up to this many calls beyond one past our own
_NAME = Text(32, NAME_PATTERN)
COUNTS = MapOf(_NAME, Integer(0, MAX_COUNT), max_len=MAX_BARRIERS)  # name -> calls made
_DIGEST = {"digest": ListOf(ENTRY, max_len=DIGEST_MAX)}  # open membership only: the sender's view, sampled
# requester -> server: "these are my counters"; answered with the server's, and what it knows of mine
BARRIER = message_kind(
    "barrier", {"from": Text(64, NAME_PATTERN), "counters": COUNTS}, _DIGEST, max_header_bytes=DIGEST_HEADER_BYTES
)
BARRIER_STATE = message_kind(
    "barrier_state", {"counters": COUNTS, "yours": COUNTS}, _DIGEST, max_header_bytes=DIGEST_HEADER_BYTES
)


class BarrierTimeout(TimeoutError):
    """Missing nodes did not arrive at a barrier in time.

    ``missing`` names them; ``counters`` holds what was last heard of each
    (their counters per barrier name; empty when they never answered).
    """

    def __init__(self, name: str, k: int, missing: list[str], counters: Mapping[str, Mapping[str, int]]) -> None:
        heard = ", ".join(f"{m} (at {counters.get(m, {}).get(name, 0)} of {k})" for m in missing)
        super().__init__(f"barrier {name!r} (call {k}): no arrival in time from {heard}")
        self.name, self.k = name, k
        self.missing = list(missing)
        self.counters = {m: dict(counters.get(m, {})) for m in missing}


class BarrierCounts:
    """A node's barrier counts (name -> calls made) and what it heard of its peers'. Thread-safe.

    Every count stays within [0, MAX_COUNT]; a peer's is capped at one call past
    ours plus SLACK (see the module docstring).

    Args:
        peers: the config's other nodes: the peers counted (without `view`).
        view: open membership: the other members *now* (re-read at each look). Counts are then kept for
            members only, at most `max_peers` of them: a name that left the view is forgotten.
        max_peers: with `view`, the most peers whose counts are kept (``members_max``).
    """

    def __init__(self, peers: list[str], view: Callable[[], Collection[str]] | None = None, max_peers: int = 0) -> None:
        self._lock = threading.Lock()
        self._own: dict[str, int] = {}
        self._heard: dict[str, dict[str, int]] = {peer: {} for peer in peers}
        self._view, self._max_peers = view, max_peers
        self._waiting: dict[str, int] = {}  # barrier name -> the call this node waits at (open membership)

    @property
    def open(self) -> bool:
        """Do the peers follow a view (open membership)?"""
        return self._view is not None

    def peers(self) -> list[str]:
        """The peers a barrier waits for now: the config's, or (open membership) the view's other members."""
        if self._view is None:
            with self._lock:
                return list(self._heard)
        return sorted(self._view())

    def own(self) -> dict[str, int]:
        with self._lock:
            return dict(self._own)

    def offered(self) -> dict[str, int]:
        """The counts a joiner takes from us. With open membership a barrier we wait at is not counted yet:
        a joiner that arrives while we wait then makes that call itself, and we wait for it."""
        with self._lock:
            counts = dict(self._own)
            if self._view is not None:
                for name, k in self._waiting.items():
                    if counts.get(name) == k:
                        counts[name] = k - 1
            return counts

    def waiting(self, name: str, k: int | None) -> None:
        """This node waits at its k-th call of `name` now (None: no longer)."""
        with self._lock:
            if k is None:
                self._waiting.pop(name, None)
            else:
                self._waiting[name] = k

    def arrive(self, name: str) -> int:
        """Count one more call of barrier `name`; returns k (this is the k-th)."""
        with self._lock:
            if name not in self._own and len(self._own) >= MAX_BARRIERS:
                raise ValueError(f"at most {MAX_BARRIERS} barrier names per node, and {name!r} would be one more")
            count = self._own.get(name, 0)
            if count >= MAX_COUNT:
                raise ValueError(f"barrier {name!r} has been called {count} times, the most a count can hold")
            self._own[name] = count + 1
            return count + 1

    def restore(self, counts: Mapping[str, int]) -> None:
        """Take counts from a checkpoint or from peers: a count never goes down.

        Raises ValueError, and takes nothing, if a name or a count is not one a barrier can have.
        """
        checked = _checked(counts)
        with self._lock:
            names = set(self._own) | set(checked)
            if len(names) > MAX_BARRIERS:
                raise ValueError(f"{len(names)} barrier names, at most {MAX_BARRIERS}")
            for name, count in checked.items():
                self._own[name] = max(self._own.get(name, 0), count)

    def heard(self, peer: str, counts: Mapping[str, int]) -> None:
        """Record what `peer` said of its counts (already checked against the wire schema), capped."""
        current = set(self._view()) if self._view is not None else None
        with self._lock:
            known = self._heard.get(peer)
            if current is not None:
                if peer not in current:
                    return  # not a member (any more): counts for nothing
                if known is None:
                    self._forget(current)
                    if len(self._heard) >= self._max_peers:
                        return
                    known = self._heard[peer] = {}
            if known is None:
                return  # not a peer of ours: counts for nothing
            for name, count in counts.items():
                if name not in known and len(known) >= MAX_BARRIERS:
                    continue
                believed = min(int(count), self._own.get(name, 0) + 1 + SLACK, MAX_COUNT)
                known[name] = max(known.get(name, 0), believed)

    def _forget(self, current: set[str]) -> None:
        """(Lock held) drop what we heard of names no longer members."""
        for gone in [peer for peer in self._heard if peer not in current]:
            del self._heard[gone]

    def of(self, peer: str) -> dict[str, int]:
        with self._lock:
            return dict(self._heard.get(peer, {}))

    def all_heard(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {peer: dict(counts) for peer, counts in self._heard.items()}

    def behind(self, name: str, k: int) -> list[str]:
        """Peers not known to have made their k-th call of `name` (open membership: the view's, now)."""
        if self._view is None:
            with self._lock:
                return [peer for peer, counts in self._heard.items() if counts.get(name, 0) < k]
        current = sorted(self._view())
        with self._lock:
            self._forget(set(current))
            return [peer for peer in current if self._heard.get(peer, {}).get(name, 0) < k]


def _checked(counts: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(counts, Mapping):
        raise ValueError(f"barrier counts must be a mapping of name -> count, got {type(counts).__name__}")
    try:
        return COUNTS.check(dict(counts))
    except ValueError as exc:
        raise ValueError(f"barrier counts {dict(counts)!r:.200}: {exc}") from None


def plausible(counts: Mapping[str, int], reports: Iterable[Mapping[str, int]]) -> tuple[dict[str, int], list[str]]:
    """`counts` a donor offers, bounded by what the cluster reports: (the counts to adopt, names cut).

    For each name the bound is the median of the `reports` (every answering peer's own counts,
    the donor's included) plus SLACK: one peer alone cannot move a joiner far past the others.
    """
    reports = list(reports)
    adopted: dict[str, int] = {}
    cut: list[str] = []
    for name, count in counts.items():
        bound = int(statistics.median_low([r.get(name, 0) for r in reports] or [0])) + SLACK
        adopted[name] = min(count, bound, MAX_COUNT)
        if count > adopted[name]:
            cut.append(name)
    return adopted, cut


class BarrierServer:
    """Answers ``barrier`` requests: records the asker's counters, tells it ours and what we know of its.

    With open membership (`members`) the asker must be a member of our view (one we do not know yet may
    introduce itself, its own entry first in its digest, as a fetch's sender may); its digest is merged, it
    was heard from, and the reply carries our digest."""

    def __init__(self, counters: BarrierCounts, peers: list[str], members: Members | None = None) -> None:
        self._counters, self._peers, self._members = counters, set(peers), members

    def routes(self) -> dict[str, Route]:
        return {BARRIER.name: Route(BARRIER, self.serve, newcomers=True)}

    def serve(self, request: Request) -> Reply:
        sender = request.sender
        members = self._members
        if members is None:
            known = sender in self._peers
        else:
            known = members.admit(sender, request.header.get("digest"), request.key, request.client)
            if not known and request.key is not None:  # keyed: a key that is no member's learns nothing
                raise ProtocolError("bad_identity", f"{sender!r} with this key is not a member of this node's view")
        if known:
            self._counters.heard(sender, request.header["counters"])
        yours = self._counters.of(sender) if known else {}
        fields: dict[str, Any] = {"counters": self._counters.own(), "yours": yours}
        if members is not None:
            fields["digest"] = members.digest()
        return Reply(encode(BARRIER_STATE, request.header.id, **fields))


class BarrierTask:
    """Tell one peer our counters and hear its own (and what it knows of ours). Value: (its, ours as it knows).

    With open membership (`members`) the request carries our digest, and the reply's is merged here (the
    Tx thread): the peer answered, so it is alive."""

    def __init__(
        self, peer: str, deadline: float, name: str, counters: dict[str, int], members: Members | None = None
    ) -> None:
        self.peer, self.deadline, self._name, self._counters = peer, deadline, name, counters
        self._members = members

    def run(self, ask: Ask) -> tuple[dict[str, int], dict[str, int]]:
        fields: dict[str, Any] = {"from": self._name, "counters": self._counters}
        if self._members is not None:
            fields["digest"] = self._members.digest()
        response = ask(lambda rid: [encode(BARRIER, rid, **fields)], {BARRIER_STATE.name: BARRIER_STATE})
        if self._members is not None:
            self._members.heard(self.peer)
            self._members.merge(self.peer, response.header.get("digest"))
        return dict(response.header["counters"]), dict(response.header["yours"])


BARRIER_POLL_MAX_S = 1.0  # a peer not yet at a barrier is asked again at most this long after the last time
DEAD_PEER_MIN_S = 10.0  # a fixed cluster's peer silent this long (at least) at a barrier, after taking part, is dead


def dead_peer_s(timeout_s: float) -> float:
    """How long a fixed cluster's peer that took part may answer no barrier poll before it counts as dead:
    four request deadlines, and at least DEAD_PEER_MIN_S."""
    return max(DEAD_PEER_MIN_S, 4 * timeout_s)


class BarrierWaiter:
    """Waits at barriers on the training thread: asks peers (on the Tx thread) until every one has arrived.

    Owns the requests it leaves behind: after a barrier, a peer that has not heard of our arrival is told,
    and nobody waits for that answer; those calls are dropped as they finish (:meth:`tidy`).

    Args:
        name: this node.
        counts: our barrier counts and what we heard of our peers'; its :meth:`BarrierCounts.peers` are
            whom a barrier waits for (open membership: the view's members, re-read at each poll round).
        submit: runs a task on the Tx thread.
        timeout_s: the deadline of one request.
        members: open membership's view: requests carry digests, and every member is asked again at
            most `keepalive_s` after its last answer while we wait (so members waiting together keep
            hearing each other, and the view keeps spreading, while nobody exchanges).
        keepalive_s: see `members`.
        took_part: open membership: did this node ever blend with this member? Members it did not,
            and are all a barrier still waits for after `idle_after_s`, are skipped; those a member for
            `retire_after_s` are retired from the view (see the module).
        idle_after_s: see `took_part` (``suspect_after_ms``).
        retire_after_s: see `took_part` (``suspect_after_ms`` + ``dead_after_ms``: as long as a dead member
            takes to leave the view).
        dead_after_s: a peer that showed a sign of life once and none for this long of a wait is dead: once
            every peer still behind is, the wait ends as at its deadline (BarrierTimeout, or going on without
            them), not after the whole `timeout_s` (a fixed cluster; open membership's view removes its dead
            members itself).
        last_sign: when a peer last showed a sign of life (monotonic seconds), None if never: the node's
            :class:`~dpwa.gossip.membership.flow.SignsOfLife`, which every reply and every request of a peer updates.
    """

    def __init__(
        self,
        name: str,
        counts: BarrierCounts,
        submit: Callable[[Any], Call],
        timeout_s: float,
        members: Members | None = None,
        keepalive_s: float = BARRIER_POLL_MAX_S,
        took_part: Callable[[str], bool] = lambda peer: True,
        idle_after_s: float = math.inf,
        retire_after_s: float = math.inf,
        dead_after_s: float = math.inf,
        last_sign: Callable[[str], float | None] = lambda peer: None,
    ) -> None:
        self._name, self._counts, self._submit, self._timeout_s = name, counts, submit, timeout_s
        self._members = members
        self._took_part, self._idle_after_s, self._retire_after_s = took_part, idle_after_s, retire_after_s
        self._dead_after_s, self._last_sign = dead_after_s, last_sign
        self._poll_max_s = min(BARRIER_POLL_MAX_S, keepalive_s) if members is not None else BARRIER_POLL_MAX_S
        self._stray: list[Call] = []  # calls whose result nobody needs (a barrier's last word to a peer)

    def tidy(self) -> None:
        """Drop the finished calls nobody waits for."""
        self._stray = [call for call in self._stray if not call.done.is_set()]

    def _task(self, peer: str, deadline: float) -> BarrierTask:
        return BarrierTask(peer, deadline, self._name, self._counts.own(), self._members)

    def wait(
        self,
        name: str,
        k: int,
        deadline: float,
        missing: str,
        stop: Callable[[], bool],
        idle: Callable[[], None],
    ) -> list[str]:
        """Wait until every peer has made its k-th call of `name` (see Node.barrier); `idle` keeps exchanging."""
        self._counts.waiting(name, k)
        try:
            return self._wait(name, k, deadline, missing, stop, idle)
        finally:
            self._counts.waiting(name, None)

    def _wait(
        self,
        name: str,
        k: int,
        deadline: float,
        missing: str,
        stop: Callable[[], bool],
        idle: Callable[[], None],
    ) -> list[str]:
        calls: dict[str, Call] = {}
        told: set[str] = set()  # peers that have heard of this arrival
        # each peer is polled again 20 ms after its last answer, doubling up to the poll maximum (not reset)
        polls: Backoffs[str] = Backoffs(min(0.02, self._poll_max_s), self._poll_max_s)
        keepalive = self._members is not None  # open membership: arrived members are asked again too
        idle_since: float | None = None  # since when only members that never took part are behind
        skipped: set[str] = set()  # members skipped for that (open membership)
        started = time.monotonic()
        while True:
            peers = self._counts.peers()  # open membership: the view now (members come and go while we wait)
            if keepalive and len(polls) > len(peers):  # forget the back-off of members that left (bounded)
                for gone in set(polls) - set(peers) - set(calls):
                    polls.reset(gone)
            for peer, call in list(calls.items()):
                if not call.done.is_set():
                    continue
                del calls[peer]
                if call.outcome == "ok":
                    theirs, _ = call.take()
                    self._counts.heard(peer, theirs)
                    told.add(peer)
                polls.fail(peer, time.monotonic())  # any answer: asked again after the next (longer) pause
            behind = [p for p in self._counts.behind(name, k) if p not in skipped]
            now = time.monotonic()
            idlers = [p for p in behind if not self._took_part(p) and p in told]  # answered, and not there yet
            if behind and self._members is not None and len(idlers) == len(behind):
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= self._idle_after_s:
                    self._skip_idle(name, k, behind)
                    skipped.update(behind)
                    behind = []
            else:
                idle_since = None
            if not behind:
                self._tell([p for p in peers if p not in told], calls)
                return sorted(p for p in skipped if self._members is not None and p in self._members)
            stopped = stop()
            dead = [p for p in behind if self._dead(p, now, started)]
            if behind and len(dead) == len(behind) and not stopped and now < deadline:
                logger.warning(
                    "%s: barrier %r (call %d): %s answered no poll for %.0f s after taking part: dead, not waited for",
                    self._name, name, k, ", ".join(dead), self._dead_after_s,
                )  # fmt: skip
                deadline = now  # as at the deadline: raise, or go on without them
            if now >= deadline or stopped:
                heard = self._counts.all_heard()
                for call in calls.values():
                    call.abandon()
                if stopped:
                    logger.info(
                        "%s: stopped at barrier %r (call %d) before %s arrived", self._name, name, k, ", ".join(behind)
                    )
                    return behind
                if missing == "raise":
                    raise BarrierTimeout(name, k, behind, heard)
                logger.warning(
                    "%s: barrier %r (call %d): proceeding without %s", self._name, name, k, ", ".join(behind)
                )
                return behind
            for peer in peers:
                wanted = keepalive or peer in behind or peer not in told
                if wanted and peer not in calls and polls.ready(peer, now):
                    end = min(deadline, now + self._timeout_s)
                    calls[peer] = self._submit(self._task(peer, end))
            idle()
            wake = min([polls.retry_at(p) for p in peers if p not in calls] + [now + 0.02])
            time.sleep(max(0.001, min(0.02, wake - now)))  # a bounded poll: the Tx thread asks meanwhile

    def _dead(self, peer: str, now: float, started: float) -> bool:
        """Is `peer` dead: one that showed a sign of life once (a reply to any request of ours, a request of its
        own: :class:`~dpwa.gossip.membership.flow.SignsOfLife`) and none for `dead_after_s` of this wait? A peer that never
        did (one still starting) is waited for until the barrier's own timeout."""
        last = self._last_sign(peer)
        return last is not None and now - max(last, started) >= self._dead_after_s

    def _skip_idle(self, name: str, k: int, behind: list[str]) -> None:
        """The members still `behind` never took part, and were all we waited for, for `idle_after_s`: skip
        them; those in the view for as long as a dead member takes to leave it are retired from it."""
        assert self._members is not None
        old = [p for p in behind if self._members.age(p) >= self._retire_after_s]
        for peer in old:
            self._members.retire(peer)
        kept = sorted(set(behind) - set(old))
        if kept:
            logger.warning(
                "%s: barrier %r (call %d): going on without %s, which never took part (no exchange with this "
                "node) and did not arrive in %.1f s",
                self._name, name, k, ", ".join(kept), self._idle_after_s,
            )  # fmt: skip

    def _tell(self, peers: list[str], calls: dict[str, Call]) -> None:
        """Best effort: let peers that have not heard of our arrival hear of it (nobody waits for the answers)."""
        self._stray.extend(calls.values())
        for peer in peers:
            if peer not in calls:
                self._stray.append(self._submit(self._task(peer, time.monotonic() + self._timeout_s)))

    def close(self) -> None:
        for call in self._stray:
            call.abandon()
        self._stray.clear()
