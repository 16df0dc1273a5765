"""The symmetric exchange's protocol, both halves, as state machines without I/O (``mode: symmetric``).

The rules of :mod:`dpwa.gossip.exchange.driver` live here: what a server answers to a
request, a confirm or an ack, when a pending exchange expires or gives way,
the one place that decides commit or abort, how long decisions are
remembered, the strikes and pauses of a peer whose exchanges fail on its side,
what a requester does with a reply and a decision, its exchanges in doubt and
when it gives up on them, the commits it knows it holds, and how a closing
node settles. Nothing here opens a socket, starts a thread, sleeps or reads a
clock: every event comes in as a call that carries the time (``now``), and
what the driver must do comes back as return values, or as halves to let go
of (``take_released``). A half is the driver's opaque handle (its snapshots):
the machine never looks inside one. So the rules are tested without a network,
by a deterministic simulation (``tests/test_exchange_sim.py``), as
:mod:`dpwa.gossip.membership.view` is for the view, after h11's sans-I/O protocol
objects.

One exchange between a requester i and a server j, and every state each side
can be in::

    requester i (client thread, then training thread)   server j (Rx thread, then training thread)
    ─────────────────────────────────────────────────   ────────────────────────────────────────────
    publish s_i; send exchange(s_i), or      ─────────►  cheap checks first (model, closing, our one
      shm_exchange(s_i's slot) on one host               unsettled exchange, a fresh snapshot), then
                                                         s_i's values (its slot locked for reading
                                                         while held); picks a fresh id xid and
                                                         f = rule.factor(s_i, s_j) <= 1/2;
                                                         PENDING(i, xid): holds s_i and a lease on
                                                         s_j; expires at receipt + the requester's
                                                         deadline (wait_ms, bounded) + TTL_MARGIN_S
                 ◄─────────  params(s_j, xid, f)  or  error(busy | not_ready | closing | ...)
    error, or no reply by the deadline: DONE,
      nothing applied (j's PENDING expires: ABORTED)
    checks s_j and recomputes f; a mismatch or too
      little time left to confirm: DONE, no confirm
      (j's PENDING expires: ABORTED)
    IN DOUBT from here on: send confirm(xid) ─────────►  PENDING, not expired: COMMITTED
                                                         PENDING, expired:      ABORTED
                                                         already decided:       the same answer
                                                         never seen/forgotten:  unknown
                 ◄─────────  decision(xid, commit | abort | unknown)
    commit: COMMITTED, applied at the next                COMMITTED: x_j += f (s_i - s_j) at j's
      update: x_i += f (s_j - s_i) (delta);                 next update_wait (or linger, or close)
      i records that it knows commit xid
    abort / unknown: ABORTED, nothing applied             ABORTED: nothing applied
    no decision by the deadline: stays IN DOUBT;
      confirm(xid) is asked again in the background
      (every step, backing off to RESOLVE_RETRY_MAX_S)
      until a decision arrives, or gives up after
      RESOLVE_LIMIT_S (DROPPED: counted and logged)

**The guarantee.** While both nodes live and their link eventually delivers,
each exchange is applied on both sides exactly once, or on neither:

* the server decides, once, in one place (:meth:`ServerMachine._decide`):
  commit only for a PENDING exchange whose snapshot is in and whose confirm
  arrived before it expired, while the server still commits; every other
  end of a pending exchange (expiry, preemption, a withdrawal, a stream that
  failed, a closing server that stopped committing) is an abort
  (:meth:`ServerMachine._abort`). It remembers each decision for
  :data:`DECISION_RETENTION_S` (the last :data:`DECISIONS_PER_PEER` per
  peer), longer than any requester keeps asking, and answers a repeated
  confirm with it;
* a requester applies its half only on ``commit`` and never gives up on a
  confirm it has sent: it learns the decision later, in the background
  (:class:`RequesterMachine`);
* exchange ids are the server's, keyed by the authenticated peer: a requester
  cannot pick, reuse or overwrite another exchange;
* f is computed by the server from the two snapshots' clocks and losses,
  recomputed and checked by the requester (:func:`check_reply`), and never
  above 1/2;
* ``close()`` settles by the same rule, within the close's deadline
  (:class:`Settling`): new exchanges are refused (``closing``); confirms are
  still answered and in-doubt ones still asked, until nothing of ours is in
  doubt and no confirm arrived for :data:`SETTLE_QUIET_S` (at once when no
  exchange we serve is pending: nothing is left to commit). Then the server
  stops committing: a confirm of an exchange still PENDING is answered abort
  (its requester applies nothing). It keeps answering the commits it made
  until each requester is known to hold its decision: a closing requester
  says so (``ack`` of its latest commit with each peer), and the closing
  server asks the others (``known``: which of these commits do you hold?),
  so a requester whose decision was lost on the way still learns it,
  however slow the link, and nothing is sent for it while nobody closes.
  Then committed halves are applied; only what is still unknown or in doubt
  when the deadline passes is logged (a commit's may move the mean).

A node takes part in one unsettled exchange at a time, as requester or as
server, and each published snapshot in at most one exchange (see
:mod:`dpwa.mixing.admission`): so a server holds at most one requester
snapshot, and a requester in doubt starts nothing until it learns the
decision. Two requests that cross (each node asks the other) would both be
refused ``busy``: the node whose name sorts first gives its own exchange up
before its confirm and serves the other's (:meth:`ServerMachine._give_way`);
if its own still gets a reply, it withdraws it (a ``confirm`` marked
``withdraw``, aborted at once) instead of confirming.

Nobody holds that one exchange against others for long. One still
unconfirmed after a few times the slowest recent confirm gives way to
another peer's request (:meth:`ServerMachine._preempt`), at once if its
requester failed recently. A peer whose served exchanges failed on its side
(expired or preempted unconfirmed, or its offered snapshot did not stream
in) :data:`EXPIRIES_BEFORE_PAUSE` times in a row is refused ``busy`` for a
pause (the ttl, doubling with each further failure up to
:data:`RESOLVE_LIMIT_S`: a :class:`~dpwa.backoff.Backoff`, reset by its next
confirm). A confirm that comes after its exchange expired or gave way takes
that strike back (a slow link, not a hostile requester; the exchange stays
aborted). So one member that asks and never confirms cuts an honest peer's
rate with a node by less than half (tests/test_hostile_member_rate.py).

None of these objects is thread-safe: the driver (:mod:`dpwa.gossip.exchange.driver`)
calls each under its own lock, or from one thread.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from ...backoff import Backoff, Backoffs
from ...mixing.admission import Admission

__all__ = [
    "ACK_TRIES",
    "CONFIRM_MEMORY_S",
    "DECISIONS_PER_PEER",
    "DECISION_RETENTION_S",
    "EXPIRIES_BEFORE_PAUSE",
    "FACTOR_TOLERANCE",
    "FAILURE_MEMORY_S",
    "KNOWN_PEERS_MAX",
    "KNOWN_PER_PEER",
    "MAX_IN_DOUBT",
    "PREEMPT_FLOOR_S",
    "PREEMPT_MARGIN",
    "QUERY_INTERVAL_S",
    "RESOLVE_LIMIT_S",
    "RESOLVE_RETRY_FIRST_S",
    "RESOLVE_RETRY_MAX_S",
    "SETTLE_QUIET_S",
    "TTL_MARGIN_S",
    "UNCONFIRMED_KEPT",
    "AckQuerySchedule",
    "Doubt",
    "Dropped",
    "KnownTable",
    "Pending",
    "RequesterMachine",
    "ServerMachine",
    "Settling",
    "check_reply",
    "decision_applies",
    "wait_s",
]

TTL_MARGIN_S = 1.0  # a PENDING exchange expires this long after the requester's deadline would
EXPIRIES_BEFORE_PAUSE = 3  # a peer whose served exchanges fail this many times in a row (expired unconfirmed, or
# its snapshot did not stream in) is paused
FAILURE_MEMORY_S = 60.0  # a peer one of whose served exchanges failed this recently holds no exchange against others
PREEMPT_MARGIN = 4.0  # an unconfirmed exchange may give way after this many times the slowest recent confirm...
PREEMPT_FLOOR_S = 0.05  # ... but not sooner than this, nor later than half the requesters' deadline
CONFIRM_MEMORY_S = 60.0  # recent: each peer's latest commit, if this recent
MAX_IN_DOUBT = 1  # exchanges a requester may be in doubt about at once (one unsettled: dpwa.mixing.admission)
RESOLVE_RETRY_FIRST_S = 0.1  # in doubt: a resolve that failed is asked again after this, doubling ...
RESOLVE_RETRY_MAX_S = 0.5  # ... up to this long after the last try
RESOLVE_LIMIT_S = 60.0  # in doubt this long: give up (the peer is gone, or the link is)
DECISION_RETENTION_S = 2 * RESOLVE_LIMIT_S  # a server remembers a decision this long...
DECISIONS_PER_PEER = 64  # ... and at most this many per peer
SETTLE_QUIET_S = 1.0  # close() waits until no confirm arrived for this long (two retry intervals), while one is pending
ACK_TRIES = 3  # a closing requester sends the ack of a commit at most this many times
KNOWN_PER_PEER = 8  # commits a requester remembers knowing, per peer (the latest; it is in doubt about one at most)
KNOWN_PEERS_MAX = 4096  # peers whose commits a requester remembers (open membership: members come and go)
QUERY_INTERVAL_S = 0.1  # a closing server asks a requester about its commits at most this often
FACTOR_TOLERANCE = 1e-9
UNCONFIRMED_KEPT = 1024  # exchanges that struck for want of a confirm, remembered (the latest) for _late

_EXACT = random.Random(0)  # the back-offs here have no jitter: never drawn from (a fresh Random costs a seeding)
H = TypeVar("H")  # the driver's handle on one half (its snapshots): opaque to the machine
Key = tuple[str, int]  # (peer, xid): an exchange, as the server named it for that peer


def _ignore(key: str) -> None:
    pass


def wait_s(wait_ms: float | None, floor_s: float, cap_s: float) -> float:
    """How long a requester waits for its exchange (its ``wait_ms``, a deadline that follows its link), within
    [floor_s, cap_s] whatever it asks; floor_s when it names none."""
    if wait_ms is None:
        return floor_s
    return min(cap_s, max(floor_s, wait_ms / 1000.0))


# --------------------------------------------------------------------------- server


@dataclass(eq=False)
class Pending(Generic[H]):
    """An exchange served and not yet decided (PENDING), or committed and not yet applied."""

    peer: str
    xid: int
    half: H  # the driver's: the snapshot we served and the requester's
    received: float  # when its request came
    expires: float  # when it is aborted unless confirmed
    arrived: bool = True  # the requester's snapshot is in (False while a bulk_exchange streams it in)


class ServerMachine(Generic[H]):
    """The server half's rules: what this node serves, and the one decision on each exchange it served.

    Also this node's own exchanges' claim on its one unsettled exchange (``take_own`` ... ``own_ended``), since
    the two compete for it (:mod:`dpwa.mixing.admission`). Halves to let go of (aborted, expired, preempted,
    withdrawn) collect in the outbox the driver empties with :meth:`take_released`. Not thread-safe.

    Args:
        name: this node (crossing exchanges are settled by name: see :meth:`_give_way`).
        ttl_s: a pending exchange's life when its requester names no deadline (the timeout plus TTL_MARGIN_S);
            also the first pause of a peer whose exchanges keep failing on its side.
        count: called with the name of each counter to raise (``exchanges_expired``, ...).
    """

    def __init__(self, name: str, ttl_s: float, count: Callable[[str], None] = _ignore) -> None:
        self.name, self.ttl_s, self._count = name, ttl_s, count
        self._released: list[H] = []
        self._pending: dict[Key, Pending[H]] = {}
        self._committed: list[Pending[H]] = []
        self._decisions: dict[str, OrderedDict[int, tuple[str, float]]] = {}
        self.admission = Admission()  # this node's one unsettled exchange (its own or one it serves)
        self._own_ticket = 0  # the ticket of our own unsettled exchange (see take_own)
        self._own_peer: str | None = None  # the peer our own exchange asks now (own_asks)
        self._own_confirming = False  # our own exchange had its reply and confirms: it no longer gives way
        # peer -> (refused until, failures in a row) of peers whose served exchanges failed on their side; the
        # pauses grow by a back-off per peer, reset by its next confirm
        self._strikes: dict[str, tuple[float, int]] = {}
        self._pauses: Backoffs[str] = Backoffs(min(ttl_s, RESOLVE_LIMIT_S), RESOLVE_LIMIT_S)
        # peer -> when one of its served exchanges last failed on its side (not forgotten at its next confirm)
        self._failed_at: dict[str, float] = {}
        # (peer, xid) of the latest exchanges that struck their requester for want of a confirm: a late confirm
        # of one takes its strike back (a slow link, not a hostile requester)
        self._unconfirmed: OrderedDict[Key, None] = OrderedDict()
        # per peer, its latest commits not yet known to be held: a requester starts no exchange with a peer
        # it is in doubt with, so only its latest few can be unknown to it
        self._unacked: dict[str, OrderedDict[int, float]] = {}
        # peer -> (seconds from its request to its confirm, when) of its latest commit
        self._confirm_took: dict[str, tuple[float, float]] = {}
        self.closing = False  # new exchanges are refused
        self.frozen = False  # closing: commit nothing more (confirms of pending exchanges are answered abort)
        self.last_confirm = 0.0  # when the last confirm came

    # ----------------------------------------------------------------- what the driver reads

    def take_released(self) -> list[H]:
        """The halves that ended without being applied since the last call: the driver lets go of them."""
        released, self._released = self._released, []
        return released

    def is_pending(self, peer: str, xid: int) -> bool:
        return (peer, xid) in self._pending

    def half(self, peer: str, xid: int) -> H | None:
        """The half of exchange `xid` while it is pending."""
        entry = self._pending.get((peer, xid))
        return entry.half if entry is not None else None

    def pending(self, now: float) -> int:
        """Exchanges served and not yet decided."""
        self.tick(now)
        return len(self._pending)

    def held(self) -> int:
        """Requester snapshots held: pending and committed-not-applied."""
        return len(self._pending) + len(self._committed)

    def pendings(self) -> Iterator[Pending[H]]:
        """The exchanges pending now (for checks)."""
        return iter(list(self._pending.values()))

    def spent(self, version: int, now: float) -> bool:
        """Has snapshot `version` taken part in an applied exchange, with nothing unsettled (publish a fresh one)?"""
        self.tick(now)
        return self.admission.spent(version)

    # ----------------------------------------------------------------- events: a request

    def tick(self, now: float) -> None:
        """Time passes: abort the pending exchanges past their time (a strike each); forget old acks."""
        # a requester gives up asking after RESOLVE_LIMIT_S: nobody waits for an ack longer
        for table in self._unacked.values():
            for xid in [x for x, t in table.items() if now - t > RESOLVE_LIMIT_S]:
                del table[xid]
        for key in [k for k, entry in self._pending.items() if self._expired(entry, now)]:
            self._abort(key, now)
            self._count("exchanges_expired")
            self._strike(key[0], now, key[1])  # its requester did not confirm in time

    def _expired(self, entry: Pending[H], now: float) -> bool:
        """Is the pending exchange past its time? Expiry is an abort."""
        return now >= entry.expires

    def refusal(self, peer: str, now: float) -> tuple[Literal["busy", "closing"], str] | None:
        """The cheap refusals of `peer`'s request, before a snapshot is leased: (reason, detail), or None."""
        self.tick(now)
        if self.closing:
            return "closing", "this node is closing"
        until = self._strikes.get(peer, (0.0, 0))[0]
        if now < until:
            return "busy", f"your last exchanges failed on your side; ask again in {until - now:.1f} s"
        return None

    def admit(self, peer: str, version: int, now: float) -> str:
        """May our snapshot `version` serve `peer`'s exchange? "" if so (it is our one unsettled exchange until
        :meth:`hold` or :meth:`unreserve`); why not, otherwise (answered ``busy``). See dpwa.mixing.admission:
        a second unsettled exchange, or a stale snapshot, could erase our state."""
        if self.admission.take(version, "served") or self._give_way(peer, version) or self._preempt(peer, now, version):
            return ""
        return self.admission.refusal(version)

    def unreserve(self) -> None:
        """The admitted exchange was not served after all (its request failed a later check)."""
        self.admission.give_back()

    def hold(self, peer: str, xid: int, half: H, received: float, expires: float, arrived: bool = True) -> None:
        """The admitted exchange is PENDING as `xid` (the server's own, fresh id), with its half, until `expires`
        (`arrived`: False while the requester's snapshot streams in)."""
        self._pending[(peer, xid)] = Pending(peer, xid, half, received, expires, arrived)

    def streamed(self, peer: str, xid: int, ok: bool, now: float) -> bool:
        """The requester's snapshot of exchange `xid` streamed in and passed its checks (`ok`), or failed. True
        when the exchange is still pending (then an `ok` snapshot belongs to its half; a failed one aborted it)."""
        entry = self._pending.get((peer, xid))
        if entry is None:
            return False  # it expired (or the node closed) while it streamed in
        if ok:
            entry.arrived = True
        else:  # nothing can commit
            self._abort((peer, xid), now)
            self._strike(peer, now)
        return True

    def _give_way(self, peer: str, version: int) -> bool:
        """`peer` asks while our own exchange asks `peer`: the two requests crossed. Each side would refuse
        the other ``busy`` and neither would average, so the side whose name sorts first serves: its own
        exchange ends here, before its confirm (:meth:`own_confirms` says no from now on; a reply that still
        comes is answered with a withdrawal), and the other side's refusal of it is the usual one. Nothing of
        our own exchange is ever applied, so the node still takes part in one exchange."""
        if self.admission.unsettled != "own" or self._own_confirming or self._own_peer != peer:
            return False
        if not self.name < peer or not self.admission.hand_over(version, "served"):
            return False
        self._own_ticket += 1  # our own exchange is over: own_asks, own_confirms and own_ended see that
        self._own_peer = None
        self._count("exchanges_given_way")
        return True

    def _preempt(self, peer: str, now: float, version: int) -> bool:
        """Serve `peer` instead of another peer's exchange that is still unconfirmed after
        :meth:`_preempt_after`, or whose requester had an exchange fail on its side in the last
        :data:`FAILURE_MEMORY_S`: abort that one (nothing was applied anywhere; its late confirm is answered
        abort, its stream in stops), count it as that requester's failure, and take the node's one exchange
        for `peer`.

        Honest requesters confirm about as fast as each other (a round trip, and the transfers), so only a
        requester that stalls is preempted. One that never confirms (or offers streams that stall) holds a
        node a few confirm times once; from then on only while nobody else asks, until its pause."""
        if len(self._pending) != 1 or self._committed:
            return False
        key, entry = next(iter(self._pending.items()))
        if key[0] == peer:
            return False
        suspect = key[0] in self._failed_at and now - self._failed_at[key[0]] < FAILURE_MEMORY_S
        if not suspect and now - entry.received < self._preempt_after(entry, now):
            return False
        self._abort(key, now)
        self._strike(key[0], now, key[1])
        self._count("exchanges_preempted")
        return self.admission.take(version, "served")

    def _preempt_after(self, entry: Pending[H], now: float) -> float:
        """How long the unconfirmed exchange `entry` is held against other peers: a few times the slowest
        recent confirm (honest requesters confirm about as fast as each other), and at most half its
        requester's deadline (all of that before any commit)."""
        limit = (entry.expires - entry.received - TTL_MARGIN_S) / 2
        recent = [took for took, at in self._confirm_took.values() if now - at < CONFIRM_MEMORY_S]
        if not recent:
            return limit
        return min(limit, max(PREEMPT_FLOOR_S, PREEMPT_MARGIN * max(recent)))

    # ----------------------------------------------------------------- events: a confirm, an ack

    def confirm(self, peer: str, xid: int, withdraw: bool, now: float) -> tuple[str, bool]:
        """A requester's confirm (commit, if still pending), or its withdrawal (``withdraw``: abort it; it gave
        way to a crossing exchange and applies nothing). Returns (the decision: commit, abort or unknown;
        or "streaming": nothing decided yet, its snapshot is still coming in), and whether it is a new commit."""
        self.last_confirm = now
        self.tick(now)  # expiry is an abort: what expired is decided before this confirm is looked at
        if self.frozen:
            self._abort_all(now)  # closing: what is still pending is aborted, not committed
        before = len(self._committed)
        outcome = self._decide(peer, xid, withdraw, now)
        if outcome != "streaming":
            self._count(f"exchanges_decided.{outcome}")
        return outcome, len(self._committed) > before

    def _decide(self, peer: str, xid: int, withdraw: bool, now: float) -> str:
        """The one commit decision: commit only a PENDING exchange whose snapshot is in and whose confirm came
        before it expired, while this node still commits. A decision made is the answer from then on."""
        known = self._decision(peer, xid)
        if known is not None:
            if not withdraw:
                self._late(peer, xid)
            return known[0]
        entry = self._pending.get((peer, xid))
        if entry is None:
            return "unknown"  # never served to this peer, or forgotten
        if withdraw:  # nothing applied anywhere: not the requester's failure, no strike
            self._abort((peer, xid), now)
            self._count("exchanges_withdrawn")
            return "abort"
        if not entry.arrived:
            return "streaming"  # nothing decided: confirm again (it expires like any pending one)
        if self.frozen or self._expired(entry, now):
            self._abort((peer, xid), now)
            return "abort"
        del self._pending[(peer, xid)]
        self._strikes.pop(peer, None)
        self._pauses.reset(peer)
        self._confirm_took[peer] = (now - entry.received, now)
        self._committed.append(entry)
        self._remember(peer, xid, "commit", now)
        unacked = self._unacked.setdefault(peer, OrderedDict())
        unacked[xid] = now
        while len(unacked) > KNOWN_PER_PEER:
            unacked.popitem(last=False)
        return "commit"

    def _abort(self, key: Key, now: float) -> None:
        """Decide abort for the pending exchange `key`: its half goes to the outbox, never applied, so its
        snapshot may serve another exchange."""
        entry = self._pending.pop(key)
        self.admission.give_back()
        self._remember(key[0], key[1], "abort", now)
        self._released.append(entry.half)

    def _abort_all(self, now: float) -> None:
        for key in list(self._pending):
            self._abort(key, now)
            self._count("exchanges_expired")

    def _decision(self, peer: str, xid: int) -> tuple[str, float] | None:
        table = self._decisions.get(peer)
        return table.get(xid) if table is not None else None

    def _remember(self, peer: str, xid: int, outcome: str, now: float) -> None:
        table = self._decisions.setdefault(peer, OrderedDict())
        table[xid] = (outcome, now)
        while len(table) > DECISIONS_PER_PEER or (table and now - next(iter(table.values()))[1] > DECISION_RETENTION_S):
            table.popitem(last=False)

    def ack(self, peer: str, xid: int) -> str:
        """`peer` says it holds our commit `xid` (a closing requester): the decision we remember."""
        self._held_up_to(peer, xid)
        known = self._decision(peer, xid)
        return known[0] if known else "unknown"

    def _strike(self, peer: str, now: float, unconfirmed: int = 0) -> None:
        """An exchange `peer` asked for failed on its side (not confirmed in time, or its snapshot did not
        stream in): after a few in a row, it waits to be served again, longer each time. `unconfirmed`: the
        exchange's xid when it was not confirmed in time; a confirm that still comes takes the strike back
        (:meth:`_late`)."""
        if unconfirmed:
            self._unconfirmed[(peer, unconfirmed)] = None
            while len(self._unconfirmed) > UNCONFIRMED_KEPT:
                self._unconfirmed.popitem(last=False)
        self._failed_at[peer] = now
        until, strikes = self._strikes.get(peer, (0.0, 0))
        strikes += 1
        until = now + self._pauses.get(peer).next() if strikes >= EXPIRIES_BEFORE_PAUSE else 0.0
        self._strikes[peer] = (until, strikes)

    def _late(self, peer: str, xid: int) -> None:
        """The confirm of `xid`, which expired (or gave way) unconfirmed, came after all: its requester is on a
        slow link, not hostile. The strike is taken back, and with it a pause it led to (the next pause still
        grows: the back-off is reset by a commit only); the exchange stays aborted, and the requester stays one
        whose exchanges give way to others' at once for a while (FAILURE_MEMORY_S), so a requester that always
        confirms late still costs others little."""
        if (peer, xid) not in self._unconfirmed:
            return  # not one that struck (or already taken back: a repeated confirm)
        del self._unconfirmed[(peer, xid)]
        until, strikes = self._strikes.get(peer, (0.0, 0))
        strikes = max(0, strikes - 1)
        self._strikes[peer] = (until if strikes >= EXPIRIES_BEFORE_PAUSE else 0.0, strikes)
        self._count("exchanges_confirmed_late")

    def forget(self, peer: str) -> None:
        """`peer` left the view or restarted: its strikes and pause were its predecessor's, and go with it (a
        node killed in the middle of exchanges would otherwise leave its restart refused busy for up to
        RESOLVE_LIMIT_S)."""
        self._strikes.pop(peer, None)
        self._pauses.reset(peer)
        self._failed_at.pop(peer, None)

    # ----------------------------------------------------------------- this node's own exchanges

    def take_own(self, version: int, now: float) -> int:
        """May our own exchange start on snapshot `version`? If so (a ticket > 0) it is our one unsettled
        exchange until :meth:`own_ended` with that ticket."""
        self.tick(now)
        if self.closing or not self.admission.take(version, "own"):
            return 0
        self._own_ticket += 1
        self._own_peer, self._own_confirming = None, False
        return self._own_ticket

    def own_asks(self, ticket: int, peer: str) -> bool:
        """Our own exchange `ticket` is about to ask `peer`: False if it is over (it gave way to a crossing
        request: ask nobody)."""
        if ticket != self._own_ticket or self.admission.unsettled != "own":
            return False
        self._own_peer = peer
        return True

    def own_confirms(self, ticket: int) -> bool:
        """Our own exchange `ticket` had its reply and is about to confirm: False if it gave way meanwhile
        (withdraw it instead); True, and from now on it gives way to nobody."""
        if ticket != self._own_ticket or self.admission.unsettled != "own":
            return False
        self._own_confirming = True
        return True

    def own_ended(self, ticket: int, applied: bool, published: int) -> None:
        """Our own exchange `ticket` is over: its half `applied` (`published`: our latest snapshot's version),
        or nothing applied on either side (as soon as that is known; again later, harmlessly)."""
        if ticket != self._own_ticket or self.admission.unsettled != "own":
            return  # ended already
        self._own_ticket += 1
        if applied:
            self.admission.settle(published)
        else:
            self.admission.give_back()

    # ----------------------------------------------------------------- training thread

    def take_committed(self, now: float) -> list[H]:
        """The committed halves, now the caller's (it applies them, calls :meth:`applied`, then lets go)."""
        self.tick(now)
        committed, self._committed = self._committed, []
        return [entry.half for entry in committed]

    def applied(self, published: int) -> None:
        """A committed half we served is applied: our snapshots so far (up to `published`) are stale."""
        self.admission.settle(published)

    # ----------------------------------------------------------------- closing

    def start_closing(self) -> None:
        """Refuse new exchanges from now on; confirms are still answered."""
        self.closing = True

    def stop_committing(self, now: float) -> None:
        """Commit nothing more: what is pending is aborted now, and so is any later confirm of it."""
        self.frozen = True
        self._abort_all(now)
        self.tick(now)

    def unacknowledged(self, now: float) -> list[Key]:
        """Commits whose requester is not yet known to hold them (peer, xid)."""
        self.tick(now)
        return [(peer, xid) for peer, table in self._unacked.items() for xid in table]

    def acknowledged(self, peer: str, xids: Sequence[int]) -> None:
        """`peer` holds these commits of ours (it said so when asked)."""
        for xid in xids:
            self._held_up_to(peer, xid)

    def _held_up_to(self, peer: str, xid: int) -> None:
        """`peer` holds our commit `xid`, so it holds every earlier commit with us too: a requester starts
        nothing while it is in doubt (dpwa.mixing.admission), so it learned each decision before it started the
        next exchange. Those need no answer from us any more."""
        table = self._unacked.get(peer)
        if table is None or xid not in table:
            return
        while table:
            first, _ = table.popitem(last=False)
            if first == xid:
                return

    def close(self) -> tuple[list[H], int]:
        """No confirm can come any more: every half still held, for the driver to let go of (pending ones and
        committed ones never applied), and how many of them were committed."""
        pending, self._pending = [entry.half for entry in self._pending.values()], {}
        committed, self._committed = [entry.half for entry in self._committed], []
        return self.take_released() + pending + committed, len(committed)


class AckQuerySchedule:
    """When a closing server asks a requester whether it holds our commits (``known``): one question per peer
    at a time, at most every :data:`QUERY_INTERVAL_S`."""

    def __init__(self) -> None:
        self._next: dict[str, float] = {}

    def due(self, unacked: Sequence[Key], asking: Collection[str], now: float) -> dict[str, list[int]]:
        """The peers to ask now (none already being asked), each with the commits it has not acknowledged."""
        asked: dict[str, list[int]] = {}
        for peer, xid in unacked:
            asked.setdefault(peer, []).append(xid)
        due = {}
        for peer, xids in asked.items():
            if peer not in asking and now >= self._next.get(peer, 0.0):
                self._next[peer] = now + QUERY_INTERVAL_S
                due[peer] = xids
        return due


class Settling:
    """How a closing node settles (``close()``): when its server stops committing, and when it is done."""

    def __init__(self) -> None:
        self.frozen = False

    def stop_committing(self, now: float, own_decided: bool, pending: int, last_confirm: float) -> bool:
        """Should the server stop committing now? Once our own exchanges are decided (our acks may still be on
        their way: an ack to a peer that closed first waits out its deadline, and must not keep us from asking
        the others about our commits), and no confirm came for SETTLE_QUIET_S: the quiet time is for a confirm
        on its way to an exchange we serve, so with none pending (new ones are refused) there is nothing left
        to commit, and nothing to wait for."""
        if self.frozen or not own_decided:
            return False
        if pending and now - last_confirm < SETTLE_QUIET_S:
            return False
        self.frozen = True
        return True

    def done(self, acks_pending: int, unacknowledged: int) -> bool:
        """Settled: the server stopped committing, our acks are delivered (or given up), and each requester
        is known to hold the commits we made."""
        return self.frozen and not acks_pending and not unacknowledged


# --------------------------------------------------------------------------- requester


def check_reply(
    xid: int | None, f: float | None, expected_f: float, now: float, deadline: float, min_confirm_s: float
) -> tuple[str, str] | None:
    """The requester's checks of a server's reply before it confirms: (reason, detail) of the first that
    fails (``bad_reply``, ``bad_factor``: a protocol error; ``timeout``: too little time left to confirm),
    or None: confirm. On any failure nothing is confirmed and the server's pending exchange expires."""
    if xid is None or f is None:
        return "bad_reply", "a reply to an exchange without its xid and f"
    if abs(f - expected_f) > FACTOR_TOLERANCE:
        return "bad_factor", f"the peer's f = {f!r}, ours is {expected_f!r} (same config?)"
    if deadline - now < min_confirm_s:
        return "timeout", "too little time left to confirm; the peer's pending exchange will expire"
    return None


def decision_applies(outcome: str) -> bool:
    """Does a decision let the requester apply its half? Only ``commit``; ``abort`` and ``unknown`` end the
    exchange with nothing applied (the server holds nothing of it)."""
    return outcome == "commit"


@dataclass(eq=False)
class Doubt(Generic[H]):
    """An exchange whose confirm was sent but whose decision has not arrived."""

    peer: str
    xid: int
    half: H
    since: float  # when it went in doubt
    retry: Backoff  # when its decision is asked again after a try failed
    asking: bool = False  # a try is on its way


@dataclass(frozen=True)
class Dropped(Generic[H]):
    """An exchange in doubt given up on: the driver lets go of its half and logs why."""

    peer: str
    xid: int
    half: H
    why: str


class RequesterMachine(Generic[H]):
    """The requester's exchanges in doubt, and their resolution: asked again (backing off from
    RESOLVE_RETRY_FIRST_S to RESOLVE_RETRY_MAX_S) until a decision comes, given up after RESOLVE_LIMIT_S,
    when the peer leaves the view, or at close. Also whether its acks go out (a closing requester). Halves that
    end unapplied collect in :meth:`take_released`. Not thread-safe.

    Args:
        count: called with the name of each counter to raise (``exchanges_in_doubt``, ...).
    """

    def __init__(self, count: Callable[[str], None] = _ignore) -> None:
        self._count = count
        self._doubts: dict[Key, Doubt[H]] = {}
        self._released: list[H] = []
        self.closing = False  # acks_to_send was called: a commit learned from now on is acknowledged at once

    def __len__(self) -> int:
        return len(self._doubts)

    def doubts(self) -> list[Doubt[H]]:
        return list(self._doubts.values())

    def take_released(self) -> list[H]:
        released, self._released = self._released, []
        return released

    def blocked_peers(self) -> frozenset[str]:
        """Peers we are in doubt with: no new exchange with them until their decision arrives."""
        return frozenset(peer for peer, _ in self._doubts)

    def can_start(self) -> bool:
        """May a new exchange start? Not while MAX_IN_DOUBT are in doubt (and not with a peer in blocked_peers)."""
        return len(self._doubts) < MAX_IN_DOUBT

    def add(self, peer: str, xid: int, half: H, now: float) -> None:
        """Our confirm of `xid` went to `peer`, and no decision came back: in doubt from now."""
        retry = Backoff(RESOLVE_RETRY_FIRST_S, RESOLVE_RETRY_MAX_S, rng=_EXACT)
        self._doubts[(peer, xid)] = Doubt(peer, xid, half, since=now, retry=retry)
        self._count("exchanges_in_doubt")

    def answered(self, peer: str, xid: int, outcome: str | None, now: float) -> H | None:
        """A try to learn `xid`'s decision ended: with `outcome`, or None (no decision: asked again later). The
        half to apply when it is a commit; None otherwise (an abort's half is released)."""
        doubt = self._doubts.get((peer, xid))
        if doubt is None:
            return None
        doubt.asking = False
        if outcome is None:
            doubt.retry.fail(now)
            return None
        del self._doubts[(peer, xid)]
        if decision_applies(outcome):
            return doubt.half
        self._released.append(doubt.half)
        self._count("exchanges_aborted")
        return None

    def due(self, now: float) -> tuple[list[Key], list[Dropped[H]]]:
        """Time passes: the exchanges to ask about now (each marked asking until :meth:`answered`), and those
        given up on (in doubt longer than RESOLVE_LIMIT_S)."""
        asks, dropped = [], []
        for key, doubt in list(self._doubts.items()):
            if doubt.asking:
                continue
            if now - doubt.since > RESOLVE_LIMIT_S:
                dropped.append(self._drop(key, f"no decision from {doubt.peer} within {RESOLVE_LIMIT_S:.0f} s"))
            elif doubt.retry.ready(now):
                doubt.asking = True
                asks.append(key)
        return asks, dropped

    def forget_gone(self, members: Collection[str]) -> list[Dropped[H]]:
        """(Open membership) A peer removed from the view will not answer: an exchange in doubt with it is
        dropped now, not after RESOLVE_LIMIT_S, in which no exchange of ours could start."""
        gone = [key for key in self._doubts if key[0] not in members]
        return [self._drop(key, "it was removed from the view (declared dead)") for key in gone]

    def close(self) -> list[Dropped[H]]:
        """Drop whatever is still in doubt: the peer never answered within the settle time."""
        return [self._drop(key, "the node closed before the peer answered") for key in list(self._doubts)]

    def _drop(self, key: Key, why: str) -> Dropped[H]:
        doubt = self._doubts.pop(key)
        self._count("exchanges_dropped")
        return Dropped(key[0], key[1], doubt.half, why)

    # ----------------------------------------------------------------- acks (closing)

    def acks_to_send(self, latest: dict[str, int]) -> list[Key]:
        """Closing: tell each peer we hold its latest commit (`latest`: KnownTable.latest), so a closing peer
        need not wait or ask; each commit learned from now on is acknowledged as it is held (:meth:`holds`)."""
        self.closing = True
        return list(latest.items())

    def holds(self) -> bool:
        """We now hold (applied) a commit: acknowledge it at once? (Yes once closing: in doubt until we closed,
        and once we are gone that peer cannot ask us.)"""
        return self.closing

    @staticmethod
    def ack_again(tries: int) -> bool:
        """An ack that was not delivered after `tries` sends: send it again?"""
        return tries < ACK_TRIES


class KnownTable:
    """The commits a requester holds (applied), per server peer: the latest few. Not thread-safe."""

    def __init__(self, peers: Sequence[str]) -> None:
        self._known: dict[str, OrderedDict[int, float]] = {peer: OrderedDict() for peer in peers}

    def record(self, peer: str, xid: int, now: float) -> None:
        table = self._known.get(peer)
        if table is None:
            if len(self._known) >= KNOWN_PEERS_MAX:
                return
            table = self._known[peer] = OrderedDict()  # a member that joined after we started
        table[xid] = now
        while len(table) > KNOWN_PER_PEER:
            table.popitem(last=False)

    def latest(self, within_s: float, now: float) -> dict[str, int]:
        """Each peer's latest commit we hold, if it is younger than `within_s`."""
        return {
            peer: next(reversed(table))
            for peer, table in self._known.items()
            if table and now - table[next(reversed(table))] < within_s
        }

    def held(self, peer: str, xids: Sequence[int]) -> list[int]:
        """Which of `xids` (commits of `peer`'s, it asks: ``known``) we hold."""
        table = self._known.get(peer)
        return [xid for xid in xids if table is not None and xid in table]
