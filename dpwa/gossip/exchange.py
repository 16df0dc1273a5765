"""Symmetric exchanges (``mode: symmetric``): both halves in one place, applied on both sides or neither.

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

* the server decides, once: commit only for a PENDING exchange whose confirm
  arrived before it expired; expiry is an abort. It remembers each decision
  for :data:`DECISION_RETENTION_S` (the last :data:`DECISIONS_PER_PEER` per
  peer), longer than any requester keeps asking, and answers a repeated
  confirm with it;
* a requester applies its half only on ``commit`` and never gives up on a
  confirm it has sent: it learns the decision later, in the background;
* exchange ids are the server's, keyed by the authenticated peer: a requester
  cannot pick, reuse or overwrite another exchange;
* f is computed by the server from the two snapshots' clocks and losses,
  recomputed and checked by the requester, and never above 1/2;
* ``close()`` settles by the same rule, within the close's deadline: new
  exchanges are refused (``closing``); confirms are still answered and
  in-doubt ones still asked, until nothing of ours is in doubt and no confirm
  arrived for :data:`SETTLE_QUIET_S` (at once when no exchange we serve is
  pending: nothing is left to commit). Then the server stops committing:
  a confirm of an exchange still PENDING is answered abort (its requester
  applies nothing). It keeps answering the commits it made until each
  requester is known to hold its decision: a closing requester says so
  (``ack`` of its latest commit with each peer), and the closing server
  asks the others (``known``: which of these commits do you hold?), so a
  requester whose decision was lost on the way still learns it, however
  slow the link, and nothing is sent for it while nobody closes. Then
  committed halves are applied; only what is still unknown or in doubt
  when the deadline passes is logged (a commit's may move the mean).

A node takes part in one unsettled exchange at a time, as requester or as
server, and each published snapshot in at most one exchange (see
:mod:`dpwa.mixing.admission`): so a server holds at most one requester
snapshot, and a requester in doubt starts nothing until it learns the
decision. Two requests that cross (each node asks the other) would both be
refused ``busy``: the node whose name sorts first gives its own exchange up
before its confirm and serves the other's (:meth:`ExchangeServer._give_way`);
if its own still gets a reply, it withdraws it (a ``confirm`` marked
``withdraw``, aborted at once) instead of confirming.

Nobody holds that one exchange against others for long. One still
unconfirmed after a few times the slowest recent confirm gives way to
another peer's request (:meth:`ExchangeServer._preempt`), at once if its
requester failed recently. A peer whose served exchanges failed on its side
(expired or preempted unconfirmed, or its offered snapshot did not stream
in) :data:`EXPIRIES_BEFORE_PAUSE` times in a row is refused ``busy`` for a
pause (the ttl, doubling with each further failure up to
:data:`RESOLVE_LIMIT_S`, reset by its next confirm). A confirm that comes
after its exchange expired or gave way takes that strike back (a slow link,
not a hostile requester; the exchange stays aborted). So one member that asks
and never confirms cuts an honest peer's rate with a node by less than half
(tests/test_hostile_member_rate.py).
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..logs import logger
from ..mixing import rules
from ..mixing.admission import Admission
from ..stats import Counters
from ..wire.bulk import BulkError
from ..wire.calls import Ask, Call, Response
from ..wire.errors import DeadlinePassed, ProtocolError, Refused, RequestTimeout, TransportError, refused
from ..wire.schema import MAX_ID, encode
from ..wire.server import Reply, Request, Route
from ..wire.shm import PeerSlots
from .deadlines import CAP_FACTOR, Deadlines
from .protocol import (
    ACK,
    BULK_EXCHANGE,
    CONFIRM,
    DECISION,
    EXCHANGE,
    KNOWN,
    KNOWN_REPLY,
    SHM_EXCHANGE,
    SNAPSHOT_REPLIES,
)
from .requesting import Arrivals, Received, ReplyReader
from .serving import Serving
from .snapshots import Lease
from .validation import PeerValues

__all__ = [
    "AckQueries",
    "ClientHalf",
    "ExchangeClient",
    "ExchangeServer",
    "ExchangeTask",
    "InDoubt",
    "KnownCommits",
    "ServerHalf",
    "StreamInTask",
]

TTL_MARGIN_S = 1.0  # a PENDING exchange expires this long after the requester's deadline would
EXPIRIES_BEFORE_PAUSE = 3  # a peer whose served exchanges fail this many times in a row (expired unconfirmed, or
# its snapshot did not stream in) is paused
FAILURE_MEMORY_S = 60.0  # a peer one of whose served exchanges failed this recently holds no exchange against others
PREEMPT_MARGIN = 4.0  # an unconfirmed exchange may give way after this many times the slowest recent confirm...
PREEMPT_FLOOR_S = 0.05  # ... but not sooner than this, nor later than half the requesters' deadline
CONFIRM_MEMORY_S = 60.0  # recent: each peer's latest commit, if this recent
MAX_IN_DOUBT = 1  # exchanges a requester may be in doubt about at once (one unsettled: dpwa.mixing.admission)
RESOLVE_RETRY_MAX_S = 0.5  # in doubt: ask again at most this long after the last try
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


class _Half:
    """One side's half of an exchange: the two snapshots and the factor. Owns both; a context manager."""

    def __init__(self, peer: str, xid: int, f: float) -> None:
        self.peer, self.xid, self.f = peer, xid, f
        self._stack = contextlib.ExitStack()

    def release(self) -> None:
        """Let go of both snapshots. Idempotent."""
        self._stack.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ClientHalf(_Half):
    """The requester's half: its own snapshot s_i (a lease) and the server's s_j (received)."""

    def __init__(self, peer: str, xid: int, f: float, own: Lease, theirs: Received) -> None:
        super().__init__(peer, xid, f)
        self.own = self._stack.enter_context(own)
        self.theirs = self._stack.enter_context(theirs)


class ServerHalf(_Half):
    """The server's half: the snapshot it served s_j (a lease) and the requester's s_i (None while it is
    still streaming in: a ``bulk_exchange``; such a half cannot commit until :meth:`attach`)."""

    def __init__(
        self, peer: str, xid: int, f: float, served: Lease, theirs: Received | None, received: float, expires: float
    ) -> None:
        super().__init__(peer, xid, f)
        self.served = self._stack.enter_context(served)
        self._theirs = self._stack.enter_context(theirs) if theirs is not None else None
        self.received, self.expires = received, expires  # when its request came, and when it expires

    @property
    def arrived(self) -> bool:
        return self._theirs is not None

    @property
    def theirs(self) -> Received:
        assert self._theirs is not None, "a half applied before the requester's snapshot arrived"
        return self._theirs

    def attach(self, theirs: Received) -> None:
        """The requester's snapshot, streamed in and checked: the half now owns it."""
        self._theirs = self._stack.enter_context(theirs)


@dataclass(eq=False)
class InDoubt:
    """A half whose confirm was sent but whose decision has not arrived."""

    half: ClientHalf
    answered: bool = False  # the peer did answer, with something other than a decision on it (alive, then)

    def release(self) -> None:
        self.half.release()


# --------------------------------------------------------------------------- requester


class ExchangeTask:
    """One exchange, on the client thread. Its value is a ClientHalf (committed) or an InDoubt.

    `peers` are the candidates, best first: a peer that answers ``busy`` (its
    snapshot already serves an exchange) is skipped for the next; when all are
    busy they are asked again after a short pause, for at most `busy_budget_s`.
    ``took_s`` is the time from the request the partner answered to its decision (the exchange's own time,
    without the busy answers before it): the sample its deadline follows (dpwa.gossip.deadlines).
    ``task.peer`` is the peer of the exchange in the end. The task owns `own`
    (our published snapshot) from construction: it goes into the half, or is
    released when the exchange ends without one.
    """

    timed = "exchange"  # its deadline follows the link (dpwa.gossip.deadlines)

    def __init__(
        self,
        peers: Sequence[str],
        deadline: float,
        own: Lease,
        fields: Callable[[str], dict[str, Any]],
        reader: ReplyReader,
        factor: Callable[[tuple[float, float | None], tuple[float, float | None]], float],
        min_confirm_s: float,
        busy_budget_s: float = 0.0,
        encode: Callable[[np.ndarray], Any] | None = None,
        slot: dict[str, Any] | None = None,
        slot_peers: frozenset[str] = frozenset(),
        offer: Callable[[str], dict[str, Any] | None] | None = None,
        withdraw: Callable[[bytes], object] = lambda token: None,
        ended: Callable[[], None] = lambda: None,
        ticket: int = 0,
        asks: Callable[[str], bool] = lambda peer: True,
        confirms: Callable[[], bool] = lambda: True,
    ) -> None:
        self._ended = ended  # called (on the Tx thread) as soon as the exchange ends with nothing applied anywhere
        # may we ask this peer / confirm now? False once our node served a crossing request instead (the
        # owner's ExchangeServer.own_asks and own_confirms)
        self._asks, self._confirms = asks, confirms
        self.ticket = ticket  # the owner's mark of this exchange (ExchangeServer.take_own)
        self._encode = encode  # wire_dtype int8: our snapshot is encoded as it is sent
        self._slot, self._slot_peers = slot, slot_peers
        self.slot_refused: dict[str, str] = {}  # peer -> why it would not read our slot (it got the payload)
        # a large snapshot for a peer on another host: offered at our bulk port (the request's fields), or None
        self._offer, self._withdraw = offer, withdraw  # withdraw: an offer the peer refused is taken back
        self._streamed = False  # the exchange in the end offered our snapshot by stream
        self.stream_refused: dict[str, str] = {}  # peer -> why it would not stream our snapshot (it got the payload)
        self._peers = list(peers)
        self.peer, self.deadline = self._peers[0], deadline
        self._own, self._fields, self._reader, self._factor = own, fields, reader, factor
        self._min_confirm_s, self._busy_budget_s = min_confirm_s, busy_budget_s
        self.busy = 0  # busy answers met on the way
        self.took_s: float | None = None  # from the answered request to the decision, once decided
        self._asked_at = 0.0  # when the request the partner answered went out
        self.busy_peers: set[str] = set()  # who answered them (they are alive: flow control and the view learn it)

    def release(self) -> None:
        """Let go of our snapshot unless a half took it: for a call that ended without running (cancelled
        while queued, or its deadline passed first). Idempotent."""
        self._own.release()

    def run(self, ask: Ask) -> ClientHalf | InDoubt:
        try:
            return self._run(ask)
        except BaseException:
            # Refused, failed, or aborted by the peer: nothing applied on either side (an answer that may have
            # committed is InDoubt, not an exception). Our node may serve again now, not at its next step.
            self._ended()
            raise

    def _run(self, ask: Ask) -> ClientHalf | InDoubt:
        with contextlib.ExitStack() as cleanup:
            cleanup.push(self._own)  # released unless a half takes it
            snap = self._own.snapshot
            response = self._find_partner(ask, snap.array)
            try:
                theirs = self._reader.read(response, self.peer, self.deadline)
            except BulkError as exc:  # nothing applied; the peer's pending exchange expires
                self._reader.bulk_failed(
                    self.peer, exc, then="the exchange is dropped", counter="bulk_exchange_streams_failed"
                )
                raise
            cleanup.push(theirs)
            header = theirs.header
            xid, f = header.get("xid"), header.get("f")
            if xid is None or f is None:
                raise ProtocolError("bad_reply", "a reply to an exchange without its xid and f")
            expected = self._factor((snap.clock, snap.loss), (header["clock"], header["loss"]))
            if abs(f - expected) > FACTOR_TOLERANCE:
                raise ProtocolError("bad_factor", f"the peer's f = {f!r}, ours is {expected!r} (same config?)")
            if self.deadline - time.monotonic() < self._min_confirm_s:
                raise RequestTimeout("too little time left to confirm; the peer's pending exchange will expire")
            name = self._fields(self.peer)["from"]
            if not self._confirms():  # our node serves this peer's crossing request: take ours back
                self._withdraw_exchange(ask, name, xid)
                raise refused("aborted", f"this node served {self.peer}'s crossing exchange instead")
            cleanup.pop_all()
        half = ClientHalf(self.peer, xid, f, self._own, theirs)
        pause = 0.001
        while True:  # bounded: "streaming" is asked again only until the deadline
            try:
                decision = ask(lambda rid: [encode(CONFIRM, rid, **{"from": name}, xid=xid)], _DECISIONS)
            except DeadlinePassed:  # nothing was sent (or only confirms answered "streaming"): it will expire
                half.release()
                raise
            except TransportError:
                return InDoubt(half)  # the confirm may have arrived: learn the decision later
            except Refused as exc:
                # our snapshot is still streaming in to the peer: nothing is decided yet; confirm again soon
                if exc.reason == "streaming" and time.monotonic() + pause < self.deadline:
                    time.sleep(pause)  # a bounded wait, on the Tx thread
                    pause = min(2 * pause, 0.016)
                    continue
                return InDoubt(half, answered=True)
            except ProtocolError:
                return InDoubt(half, answered=True)
            break
        outcome = decision.header["outcome"]
        if decision.header["xid"] != xid:
            return InDoubt(half, answered=True)  # a confused peer: ask again later
        self.took_s = time.monotonic() - self._asked_at
        if outcome == "commit":
            return half
        half.release()
        if self._streamed:  # the peer may not reach our bulk port: the payload, for a while
            self._reader.bulk_failed(
                self.peer,
                f"it decided {outcome} for an exchange whose snapshot we offered by stream",
                then="the next exchanges with it carry the snapshot",
                counter="bulk_exchanges_aborted",
            )
        raise refused("aborted", f"the peer decided {outcome} for exchange {xid}")

    def _withdraw_exchange(self, ask: Ask, name: str, xid: int) -> None:
        """Tell the peer at once that exchange `xid` will not be confirmed (it is aborted there, and its
        snapshot serves again); if that is lost, it expires as an unconfirmed one does."""
        with contextlib.suppress(DeadlinePassed, TransportError, Refused, ProtocolError):
            ask(lambda rid: [encode(CONFIRM, rid, **{"from": name}, xid=xid, withdraw=True)], _DECISIONS)

    def _find_partner(self, ask: Ask, array: np.ndarray) -> Response:
        """Send the exchange to the first candidate that is not busy.

        A same-host peer is asked by naming our snapshot's slot, and a large model's peer on another host
        by offering it at our bulk port; a peer that cannot read it that way (it answers ``shm_*`` or
        ``bulk_unavailable``), or does not know that request (an older dpwa), is asked again at once with
        the snapshot as the payload.
        """
        give_up = min(time.monotonic() + self._busy_budget_s, self.deadline - self._min_confirm_s)
        pause = 0.001
        payload: list[Any] = []  # encoded once, when a peer first needs it

        def with_payload(rid: int, fields: dict[str, Any]) -> list[Any]:
            if not payload:
                payload.append(self._encode(array) if self._encode is not None else array)
            return [encode(EXCHANGE, rid, **fields), payload[0]]

        while True:
            for peer in self._peers:
                if not self._asks(peer):
                    raise refused("busy", "this node serves a crossing exchange instead of its own")
                self.peer = peer
                fields = self._fields(peer)
                for how in ("slot", "stream", "payload"):  # at most twice: by slot or stream, then the payload
                    if how == "slot" and (self._slot is None or peer not in self._slot_peers):
                        continue
                    ticket = None
                    if how == "stream" and (self._offer is None or (ticket := self._offer(peer)) is None):
                        continue

                    def request(
                        rid: int, fields: dict[str, Any] = fields, how: str = how, ticket: Any = ticket
                    ) -> list[Any]:
                        if how == "slot":
                            return [encode(SHM_EXCHANGE, rid, **fields, **(self._slot or {}))]
                        if how == "stream":
                            return [encode(BULK_EXCHANGE, rid, **fields, **ticket)]
                        return with_payload(rid, fields)

                    try:
                        self._asked_at = time.monotonic()
                        response = ask(request, SNAPSHOT_REPLIES)
                        self._streamed = ticket is not None
                        return response
                    except Refused as exc:
                        if ticket is not None:  # refused before it was streamed: not kept for its expiry
                            self._withdraw(ticket["token"])
                        if how == "slot" and (exc.reason.startswith("shm_") or exc.reason in _UNKNOWN_KIND):
                            self.slot_refused[peer] = exc.reason
                            continue
                        if how == "stream" and exc.reason in ("bulk_unavailable", *_UNKNOWN_KIND):
                            self.stream_refused[peer] = exc.reason
                            continue
                        if exc.reason != "busy":
                            raise
                        self.busy += 1
                        self.busy_peers.add(peer)
                        break
            if time.monotonic() + pause >= give_up:
                raise refused("busy", f"every peer asked is busy ({', '.join(self._peers)})")
            time.sleep(pause)  # a bounded retry: a busy peer publishes a fresh snapshot at its next step
            pause = min(2 * pause, 0.008)


_DECISIONS = {DECISION.name: DECISION}
_UNKNOWN_KIND = ("bad_kind", "unexpected_kind")  # how a server that does not serve shm_exchange answers it


class StreamInTask:
    """(Server) stream in the snapshot a requester offered with its ``bulk_exchange``, checked as a reply
    is, and hand it to `done` (or None and why, when it fails). Runs on its own client thread: it needs no
    ZeroMQ channel, and must not wait behind our own exchanges on the Tx thread."""

    def __init__(
        self,
        peer: str,
        deadline: float,
        header: Any,
        reader: ReplyReader,
        done: Callable[[Received | None, str], None],
        cancelled: Callable[[], bool],
    ) -> None:
        self.peer, self.deadline = peer, deadline
        self._header, self._reader, self._done, self._cancelled = header, reader, done, cancelled

    def run(self, ask: Ask) -> None:
        if self._cancelled():  # its exchange ended while it waited in the queue
            self._done(None, "cancelled")
            return
        try:
            received = self._reader.read_offer(self._header, self.peer, self.deadline, self._cancelled)
        except BaseException as exc:
            self._done(None, str(exc) or type(exc).__name__)
            raise
        self._done(received, "")


class ResolveTask:
    """Ask a peer again for its decision on an exchange we are in doubt about. Value: the outcome."""

    timed = "confirm"  # its deadline follows the link (dpwa.gossip.deadlines)

    def __init__(self, peer: str, deadline: float, name: str, xid: int) -> None:
        self.peer, self.deadline, self._name, self.xid = peer, deadline, name, xid

    def run(self, ask: Ask) -> str:
        response = ask(lambda rid: [encode(CONFIRM, rid, **{"from": self._name}, xid=self.xid)], _DECISIONS)
        if response.header["xid"] != self.xid:
            raise ProtocolError("bad_reply", f"a decision on {response.header['xid']}, asked about {self.xid}")
        return str(response.header["outcome"])


class AckTask:
    """Tell a peer we hold its commit of an exchange (a closing peer waits for that). Value: its outcome."""

    def __init__(self, peer: str, deadline: float, name: str, xid: int) -> None:
        self.peer, self.deadline, self._name, self.xid = peer, deadline, name, xid

    def run(self, ask: Ask) -> str:
        response = ask(lambda rid: [encode(ACK, rid, **{"from": self._name}, xid=self.xid)], _DECISIONS)
        return str(response.header["outcome"])


class KnownTask:
    """(A closing server) ask a requester which of our commits it holds. Value: those xids."""

    def __init__(self, peer: str, deadline: float, name: str, xids: list[int]) -> None:
        self.peer, self.deadline, self._name, self.xids = peer, deadline, name, xids[:8]

    def run(self, ask: Ask) -> list[int]:
        fields = {"from": self._name, "xids": self.xids}
        response = ask(lambda rid: [encode(KNOWN, rid, **fields)], {KNOWN_REPLY.name: KNOWN_REPLY})
        return [xid for xid in response.header["xids"] if xid in self.xids]


class KnownCommits:
    """The commits a requester holds (applied), per server peer: the latest few. Thread-safe.

    The training thread records them; the Rx thread answers a closing server's ``known`` from them.
    """

    def __init__(self, peers: list[str]) -> None:
        self._lock = threading.Lock()
        self._known: dict[str, OrderedDict[int, float]] = {peer: OrderedDict() for peer in peers}

    def record(self, peer: str, xid: int) -> None:
        with self._lock:
            table = self._known.get(peer)
            if table is None:
                if len(self._known) >= KNOWN_PEERS_MAX:
                    return
                table = self._known[peer] = OrderedDict()  # a member that joined after we started
            table[xid] = time.monotonic()
            while len(table) > KNOWN_PER_PEER:
                table.popitem(last=False)

    def latest(self, within_s: float) -> dict[str, int]:
        """Each peer's latest commit we hold, if it is younger than `within_s`."""
        now = time.monotonic()
        with self._lock:
            return {
                peer: next(reversed(table))
                for peer, table in self._known.items()
                if table and now - table[next(reversed(table))] < within_s
            }

    def routes(self) -> dict[str, Route]:
        return {KNOWN.name: Route(KNOWN, self.serve)}

    def serve(self, request: Request) -> Reply:
        peer = request.sender
        with self._lock:
            table = self._known.get(peer)
            held = [xid for xid in request.header["xids"] if table is not None and xid in table]
        return Reply(encode(KNOWN_REPLY, request.header.id, xids=held))


@dataclass(eq=False)
class _Doubt:
    half: ClientHalf
    since: float
    next_try: float
    tries: int = 0
    call: Call | None = None


class ExchangeClient:
    """The requester's exchanges in doubt, and their resolution (training thread only).

    Args:
        name: this node.
        peers: the nodes we may exchange with.
        timeout_s: the deadline of one resolve request.
        submit: runs a task on the client thread.
        counters: where to count committed, aborted and dropped exchanges.
        heard: called with a peer that answered (flow control: it is alive).
        ended: called when an exchange in doubt ends with nothing applied here (aborted, unknown, dropped).
        deadlines: each peer's deadlines, which follow its link (dpwa.gossip.deadlines): a resolve request is
            given the peer's, and each answered or timed-out one teaches it; None: `timeout_s` each time.
    """

    def __init__(
        self,
        name: str,
        peers: Sequence[str],
        timeout_s: float,
        submit: Callable[[Any], Call],
        counters: Counters,
        heard: Callable[[str], None] = lambda peer: None,
        ended: Callable[[], None] = lambda: None,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.name, self._timeout_s, self._submit, self._counters = name, timeout_s, submit, counters
        self._deadlines = deadlines
        self._heard, self._ended = heard, ended
        self._doubts: dict[tuple[str, int], _Doubt] = {}
        self.known = KnownCommits(list(peers))
        self._acks: list[tuple[AckTask, Call, int]] = []  # a closing node's acks on their way (task, call, tries)
        self._closing = False  # send_acks was called: a commit learned from now on is acknowledged at once

    def __len__(self) -> int:
        return len(self._doubts)

    def blocked_peers(self) -> frozenset[str]:
        """Peers we are in doubt with: no new exchange with them until their decision arrives."""
        return frozenset(peer for peer, _ in self._doubts)

    def can_start(self) -> bool:
        """May a new exchange start? Not while MAX_IN_DOUBT are in doubt (and not with a peer in blocked_peers)."""
        return len(self._doubts) < MAX_IN_DOUBT

    def add(self, doubt: InDoubt) -> None:
        half = doubt.half
        now = time.monotonic()
        self._doubts[(half.peer, half.xid)] = _Doubt(half, since=now, next_try=now)
        self._counters.add("exchanges_in_doubt")

    def hold(self, half: ClientHalf) -> None:
        """We hold (have applied) `half`'s commit: a closing peer that asks learns it."""
        self.known.record(half.peer, half.xid)
        if self._closing:  # in doubt until we closed: once we are gone that peer cannot ask us, so tell it now
            self._ack(half.peer, half.xid)

    def send_acks(self) -> None:
        """Closing: tell each peer we hold its latest commit, so a closing peer need not wait or ask (and each
        commit learned from now on, as it is held)."""
        self._closing = True
        for peer, xid in self.known.latest(RESOLVE_LIMIT_S).items():
            self._ack(peer, xid)

    def _ack(self, peer: str, xid: int) -> None:
        task = AckTask(peer, self.closing_deadline(), self.name, xid)
        self._acks.append((task, self._submit(task), 1))

    def closing_deadline(self) -> float:
        """The deadline of a request a closing node queues now: one request's time from when the acks queued
        before it are over. The client thread sends one after another, and a request behind an ack to a peer
        that already closed (which waits its whole deadline) must not expire unsent."""
        return time.monotonic() + self._timeout_s * (1 + sum(not call.done.is_set() for _, call, _ in self._acks))

    def acks_pending(self) -> int:
        return len(self._acks)

    def _tend_acks(self) -> None:
        keep = []
        for task, call, tries in self._acks:
            if not call.done.is_set():
                keep.append((task, call, tries))
            elif call.outcome in ("timeout", "failed", "expired") and tries < ACK_TRIES:
                again = AckTask(task.peer, self.closing_deadline(), self.name, task.xid)
                keep.append((again, self._submit(again), tries + 1))
            elif call.outcome in ("timeout", "failed", "expired"):
                self._counters.add("acks_lost")  # that peer may ask us instead (known), or wait out its close
        self._acks = keep

    def poll(self) -> list[ClientHalf]:
        """Collect decisions; returns the halves now known committed (the caller applies, then acknowledges them)."""
        self._tend_acks()
        now = time.monotonic()
        ready = []
        for key, doubt in list(self._doubts.items()):
            call = doubt.call
            if call is not None and call.done.is_set():
                doubt.call = None
                if call.outcome in ("ok", "refused", "rejected"):
                    self._heard(doubt.half.peer)
                if self._deadlines is not None and call.outcome == "ok" and call.latency_s is not None:
                    self._deadlines.sample(doubt.half.peer, ResolveTask.timed, call.latency_s)
                elif self._deadlines is not None and call.outcome == "timeout":
                    self._deadlines.timed_out(doubt.half.peer, ResolveTask.timed)
                if call.outcome == "ok":
                    outcome = call.take()
                    del self._doubts[key]
                    if outcome == "commit":
                        ready.append(doubt.half)
                    else:
                        doubt.half.release()
                        self._counters.add("exchanges_aborted")
                        self._ended()
                    continue
                doubt.next_try = now + min(RESOLVE_RETRY_MAX_S, 0.05 * 2**doubt.tries)
            if doubt.call is None:
                if now - doubt.since > RESOLVE_LIMIT_S:
                    self._drop(key, f"no decision from {doubt.half.peer} within {RESOLVE_LIMIT_S:.0f} s")
                elif now >= doubt.next_try:
                    doubt.tries += 1
                    wait_s = self._timeout_s
                    if self._deadlines is not None:
                        wait_s = self._deadlines.deadline_s(doubt.half.peer, ResolveTask.timed)
                    task = ResolveTask(doubt.half.peer, now + wait_s, self.name, doubt.half.xid)
                    doubt.call = self._submit(task)
        return ready

    def forget_gone(self, members: Collection[str]) -> None:
        """(Open membership) A peer removed from the view will not answer: an exchange in doubt with it is
        dropped now (logged), not after RESOLVE_LIMIT_S, in which no exchange of ours could start."""
        for key in [key for key in self._doubts if key[0] not in members]:
            self._drop(key, "it was removed from the view (declared dead)")

    def _drop(self, key: tuple[str, int], why: str) -> None:
        doubt = self._doubts.pop(key)
        if doubt.call is not None:
            doubt.call.abandon()
        doubt.half.release()
        self._counters.add("exchanges_dropped")
        self._ended()
        logger.warning(
            "%s: gave up on exchange %d with %s: %s; if the peer committed it, "
            "the nodes' mean moved by that exchange's correction",
            self.name,
            key[1],
            key[0],
            why,
        )

    def close(self) -> None:
        """Drop whatever is still in doubt (logged): the peer never answered within the settle time."""
        for key in list(self._doubts):
            self._drop(key, "the node closed before the peer answered")
        for _, call, _ in self._acks:
            call.abandon()
        self._acks.clear()


# --------------------------------------------------------------------------- server


class ExchangeServer:
    """The server half: decides on exchanges (Rx thread) and hands committed ones over (training thread).

    Args:
        name: this node (crossing exchanges are settled by name: see :meth:`_give_way`).
        serving: builds the snapshot replies, and checks the requester's model.
        values: the checks the requester's snapshot must pass.
        rule: the mixing rule (how f is computed, and checked against the requester's).
        timeout_s: the requesters' deadline (a pending exchange expires after it plus a margin).
        counters: where to count.
        wait_cap_s: the longest deadline a requester may name (``wait_ms``); None: CAP_FACTOR x `timeout_s`.
        slots: the same-host peers whose snapshots an exchange may name in their shared-memory slots,
            each with its own reader (used on the Rx thread only; closed by :meth:`close`).
        streams_in: where requesters' snapshots offered at their bulk ports are read (``bulk_exchange``):
            a client thread's ``submit`` (never the Tx thread, which may wait on that requester itself) and
            the reader it streams with; None refuses such exchanges (``bulk_unavailable``: the requester
            sends the payload instead).
    """

    def __init__(
        self,
        name: str,
        serving: Serving,
        values: PeerValues,
        rule: rules.Rule,
        timeout_s: float,
        counters: Counters,
        wait_cap_s: float | None = None,
        slots: dict[str, PeerSlots] | None = None,
        streams_in: tuple[Callable[[Any], Call], ReplyReader] | None = None,
    ) -> None:
        self._serving, self._store = serving, serving.store
        self._streams_in = streams_in
        self._closed = threading.Event()  # set by close(): a stream still coming in stops
        # same-host requesters' slots, read in place (shm_exchange); this thread's own mappings and locks
        self._slots = dict(slots or {})
        self._values = values
        self._rule = rule
        self.ttl_s = timeout_s + TTL_MARGIN_S  # a pending exchange's life when its requester names no deadline
        # what a requester may name: within [timeout_s, the cap]
        self._wait_floor_s = timeout_s
        self._wait_cap_s = max(timeout_s, CAP_FACTOR * timeout_s if wait_cap_s is None else wait_cap_s)
        # peer -> (seconds from its request to its confirm, when) of its latest commit
        self._confirm_took: dict[str, tuple[float, float]] = {}
        # requester snapshots that came in chunks (or encoded): received into our slot nobody holds, if any
        self._arrivals = Arrivals(serving.model, spare=serving.store.borrow)
        self._counters = counters
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], ServerHalf] = {}
        self._committed: list[ServerHalf] = []
        self._decisions: dict[str, OrderedDict[int, tuple[str, float]]] = {}
        # this node's one unsettled exchange (its own or one it serves), and which snapshots are stale
        self._admission = Admission()
        self._own_ticket = 0  # the ticket of our own unsettled exchange (see take_own)
        self._name = name
        self._own_peer: str | None = None  # the peer our own exchange asks now (own_asks)
        self._own_confirming = False  # our own exchange had its reply and confirms: it no longer gives way
        # peers whose served exchanges failed on their side: peer -> (refused until, pause, failures in a row)
        self._paused: dict[str, tuple[float, float, int]] = {}
        # peer -> when one of its served exchanges last failed on its side (not forgotten at its next confirm)
        self._failed_at: dict[str, float] = {}
        # (peer, xid) of the latest exchanges that struck their requester for want of a confirm: a late confirm
        # of one takes its strike back (a slow link, not a hostile requester)
        self._unconfirmed: OrderedDict[tuple[str, int], None] = OrderedDict()
        # per peer, its latest commits not yet known to be held: a requester starts no exchange with a peer
        # it is in doubt with, so only its latest few can be unknown to it
        self._unacked: dict[str, OrderedDict[int, float]] = {}
        self._closing = False
        self._frozen = False  # closing: confirms of pending exchanges are answered abort
        self.last_confirm = 0.0  # time.monotonic() of the last confirm received
        self.committed = threading.Event()  # set when an exchange commits (a lingering node waits on it)

    def routes(self) -> dict[str, Route]:
        return {
            EXCHANGE.name: Route(  # a newcomer may introduce itself with an exchange (Serving.check_request)
                EXCHANGE, self.serve_exchange, max_payload_bytes=self._serving.model.nbytes, bulk=True, newcomers=True
            ),
            SHM_EXCHANGE.name: Route(SHM_EXCHANGE, self.serve_shm_exchange),
            BULK_EXCHANGE.name: Route(BULK_EXCHANGE, self.serve_bulk_exchange, bulk=True),
            CONFIRM.name: Route(CONFIRM, self.serve_confirm),
            ACK.name: Route(ACK, self.serve_ack),
        }

    # ----------------------------------------------------------------- Rx thread

    def serve_exchange(self, request: Request) -> Reply:
        """An exchange whose requester's snapshot came with it, as the payload."""

        def receive() -> Received:
            payload = request.payload[0]
            if len(payload) != self._serving.model.nbytes:
                raise ProtocolError(
                    "bad_size", f"the payload holds {len(payload)} bytes, expected {self._serving.model.nbytes}"
                )
            return Received(request.header, *self._arrivals.take(payload, request.header, request.header["from"]))

        return self._serve(request, receive)

    def serve_shm_exchange(self, request: Request) -> Reply:
        """An exchange whose requester's snapshot waits in its shared-memory slot (same host). The slot is
        locked for reading and copied into a slot of ours that nobody holds (``SnapshotStore.borrow``), then
        let go at once, so that the requester may publish into it again (it has two slots; one locked until
        our half was applied, at our next step, made its publishes skip and its next exchange wait: 8 steps
        of 144 under torchrun). Without a slot to spare, it is read in place and stays locked until the
        exchange is applied or expires, so the requester cannot rewrite it meanwhile. A requester whose slots
        we cannot read is told ``shm_unavailable`` (it sends the payload instead)."""
        header, peer = request.header, request.sender
        slots = self._slots.get(peer)
        if slots is None:
            raise ProtocolError("shm_unavailable", f"{peer} is not a same-host peer whose slots this node reads")

        def receive() -> Received:
            model = self._serving.model
            view = slots.acquire(
                header["shm_id"], header["shm_slot"], header["version"], model.kept_nbytes, model.storage
            )
            self._counters.add("shm_exchanges_served")
            lent = self._store.borrow()  # a slot of ours, of the same size and dtype as every snapshot
            if lent is None:
                return Received(header, view.array, view.release)  # read in place, locked until applied
            copy, give_back = lent
            try:
                np.copyto(copy, view.array)
            except BaseException:
                give_back()
                raise
            finally:
                view.release()
            self._counters.add("shm_exchanges_copied")
            return Received(header, copy, give_back)

        return self._serve(request, receive)

    def serve_bulk_exchange(self, request: Request) -> Reply:
        """An exchange whose requester's snapshot waits at its bulk port (another host, a large model).

        The exchange is PENDING at once, without that snapshot: it streams in on a thread of its own,
        checked block by block, while the requester reads ours. A confirm that comes before it is in is
        answered ``streaming`` (confirm again); a stream that fails aborts the exchange.
        """
        if self._streams_in is None or request.sender not in self._streams_in[1].bulk_hosts:
            raise ProtocolError(
                "bulk_unavailable", f"this node reads no bulk streams from {request.sender}; send the payload"
            )
        return self._serve(request, None)

    def _streamed(self, peer: str, xid: int, theirs: Received | None, why: str) -> None:
        """(The stream thread) the requester's snapshot of exchange `xid` is in and checked, or failed."""
        gone: ServerHalf | None = None
        with self._lock:
            half = self._pending.get((peer, xid))
            if half is not None and theirs is not None:
                half.attach(theirs)
                theirs = None
            elif half is not None:  # the stream failed: nothing can commit
                gone = self._abort((peer, xid), time.monotonic())
                self._strike(peer, time.monotonic())
        if theirs is not None:
            theirs.release()  # the exchange expired (or the node closed) while it streamed in
        if gone is not None:
            gone.release()
            self._counters.add("bulk_exchange_streams_failed")
            logger.info("dpwa: exchange %d with %s aborted: its snapshot did not stream in (%s)", xid, peer, why)

    def _serve(self, request: Request, receive: Callable[[], Received] | None) -> Reply:
        """Hold an exchange PENDING and answer with our snapshot. `receive` takes hold of the requester's
        snapshot (checked here); None: it streams in from the requester's bulk port (``bulk_exchange``)."""
        header, peer = request.header, request.sender
        self._serving.check_request(header, request.key, request.client)
        self._serving.check_budget(request)
        with contextlib.ExitStack() as undo:
            served = self._reserve(peer)  # cheap refusals before looking at the requester's snapshot
            undo.push(served)
            undo.callback(self._unreserve)
            theirs = None
            if receive is not None:
                theirs = receive()
                undo.push(theirs)
                self._values.check(theirs.array)
            snap = served.snapshot
            requester = rules.Side(header["clock"], header["loss"])
            f = self._rule.factor(requester, rules.Side(snap.clock, snap.loss), symmetric=True)
            xid = secrets.randbelow(MAX_ID) + 1
            now = time.monotonic()
            wait_s = self._wait_s(header)
            half = ServerHalf(peer, xid, f, served, theirs, received=now, expires=now + wait_s + TTL_MARGIN_S)
            reply = self._serving.reply(request, half.served.share(), xid=xid, f=f)
            undo.pop_all()
        with self._lock:
            self._pending[(peer, xid)] = half
        self._counters.add("exchanges_served")
        if receive is None:
            assert self._streams_in is not None
            submit, reader = self._streams_in
            done = functools.partial(self._streamed, peer, xid)
            key = (peer, xid)

            def cancelled() -> bool:  # closing, or the exchange is over (aborted, preempted, expired)
                return self._closed.is_set() or key not in self._pending

            submit(StreamInTask(peer, now + wait_s, header, reader, done, cancelled))
            self._counters.add("bulk_exchanges_served")
        return reply

    def _wait_s(self, header: Any) -> float:
        """How long the requester waits for this exchange (its ``wait_ms``, a deadline that follows its link),
        within [timeout_ms, CAP_FACTOR x timeout_ms] whatever it asks; timeout_ms when it names none."""
        wait_ms = header.get("wait_ms")
        if wait_ms is None:
            return self._wait_floor_s
        return min(self._wait_cap_s, max(self._wait_floor_s, wait_ms / 1000.0))

    def _reserve(self, peer: str) -> Lease:
        with self._lock:
            now = time.monotonic()
            self._expire(now)
            if self._closing:
                raise refused("closing", "this node is closing")
            until = self._paused.get(peer, (0.0, 0.0, 0))[0]
            if now < until:
                raise refused("busy", f"your last exchanges failed on your side; ask again in {until - now:.1f} s")
            served = self._store.lease()
            if served is None:
                raise refused(*self._store.refusal())
            # see dpwa.mixing.admission: a second unsettled exchange, or a stale snapshot, could erase our state
            version = served.snapshot.version
            if (
                not self._admission.take(version, "served")
                and not self._give_way(peer, version)
                and not self._preempt(peer, now, version)
            ):
                why = self._admission.refusal(version)
                served.release()
                raise refused("busy", why)
            return served

    def _give_way(self, peer: str, version: int) -> bool:
        """(With the lock held) `peer` asks while our own exchange asks `peer`: the two requests crossed. Each
        side would refuse the other ``busy`` and neither would average, so the side whose name sorts first
        serves: its own exchange ends here, before its confirm (:meth:`own_confirms` says no from now on; a
        reply that still comes is answered with an abort), and the other side's refusal of it is the usual
        one. Nothing of our own exchange is ever applied, so the node still takes part in one exchange."""
        if self._admission.unsettled != "own" or self._own_confirming or self._own_peer != peer:
            return False
        if not self._name < peer or not self._admission.hand_over(version, "served"):
            return False
        self._own_ticket += 1  # our own exchange is over: own_asks, own_confirms and own_ended see that
        self._own_peer = None
        self._counters.add("exchanges_given_way")
        return True

    def _preempt(self, peer: str, now: float, version: int) -> bool:
        """(With the lock held) serve `peer` instead of another peer's exchange that is still unconfirmed
        after :meth:`_preempt_after`, or whose requester had an exchange fail on its side in the last
        :data:`FAILURE_MEMORY_S`: abort that one (nothing was applied anywhere; its late confirm is answered
        abort, its stream in stops), count it as that requester's failure, and take the node's one
        exchange for `peer`.

        Honest requesters confirm about as fast as each other (a round trip, and the transfers), so only a
        requester that stalls is preempted. One that never confirms (or offers streams that stall) holds a
        node a few confirm times once; from then on only while nobody else asks, until its pause."""
        if len(self._pending) != 1 or self._committed:
            return False
        key, half = next(iter(self._pending.items()))
        if key[0] == peer:
            return False
        suspect = key[0] in self._failed_at and now - self._failed_at[key[0]] < FAILURE_MEMORY_S
        if not suspect and now - half.received < self._preempt_after(half):
            return False
        self._abort(key, now).release()
        self._strike(key[0], now, key[1])
        self._counters.add("exchanges_preempted")
        return self._admission.take(version, "served")

    def _preempt_after(self, half: ServerHalf) -> float:
        """(With the lock held) how long the unconfirmed exchange `half` is held against other peers: a few
        times the slowest recent confirm (honest requesters confirm about as fast as each other), and at most
        half its requester's deadline (all of that before any commit)."""
        now = time.monotonic()
        limit = (half.expires - half.received - TTL_MARGIN_S) / 2
        recent = [took for took, at in self._confirm_took.values() if now - at < CONFIRM_MEMORY_S]
        if not recent:
            return limit
        return min(limit, max(PREEMPT_FLOOR_S, PREEMPT_MARGIN * max(recent)))

    def _unreserve(self) -> None:
        with self._lock:
            self._admission.give_back()

    # ----------------------------------------------------------------- this node's own exchanges

    def take_own(self, version: int) -> int:
        """(Training thread) May our own exchange start on snapshot `version`? If so (a ticket > 0) it is our
        one unsettled exchange until :meth:`own_ended` with that ticket."""
        with self._lock:
            self._expire(time.monotonic())
            if self._closing or not self._admission.take(version, "own"):
                return 0
            self._own_ticket += 1
            self._own_peer, self._own_confirming = None, False
            return self._own_ticket

    def own_asks(self, ticket: int, peer: str) -> bool:
        """(Tx thread) Our own exchange `ticket` is about to ask `peer`: False if it is over (it gave way to a
        crossing request: ask nobody)."""
        with self._lock:
            if ticket != self._own_ticket or self._admission.unsettled != "own":
                return False
            self._own_peer = peer
            return True

    def own_confirms(self, ticket: int) -> bool:
        """(Tx thread) Our own exchange `ticket` had its reply and is about to confirm: False if it gave way
        meanwhile (withdraw it instead); True, and from now on it gives way to nobody."""
        with self._lock:
            if ticket != self._own_ticket or self._admission.unsettled != "own":
                return False
            self._own_confirming = True
            return True

    def own_ended(self, ticket: int, applied: bool) -> None:
        """Our own exchange `ticket` is over: its half `applied` (training thread), or nothing applied on
        either side (any thread, as soon as that is known; again later, harmlessly)."""
        with self._lock:
            if ticket != self._own_ticket or self._admission.unsettled != "own":
                return  # ended already
            self._own_ticket += 1
            if applied:
                self._settle()
            else:
                self._admission.give_back()

    def _settle(self) -> None:
        current = self._store.current()
        self._admission.settle(current.version if current is not None else 0)

    def serve_confirm(self, request: Request) -> Reply:
        """A requester's confirm (commit, if still pending), or its withdrawal (``withdraw``: abort it; it
        gave way to a crossing exchange and applies nothing). Either is answered with the decision."""
        peer, xid = request.sender, request.header["xid"]
        now = time.monotonic()
        withdrawn: ServerHalf | None = None
        with self._lock:
            self.last_confirm = now
            self._expire(now)
            if self._frozen:
                self._expire(now, everything=True)  # closing: what is still pending is aborted, not committed
            known = self._decisions.get(peer, {}).get(xid)
            half = self._pending.get((peer, xid)) if known is None else None
            streaming = half is not None and not half.arrived
            outcome = ""
            if known is not None:
                outcome = known[0]
                if not request.header.get("withdraw"):
                    self._late(peer, xid)
            elif request.header.get("withdraw"):
                outcome = "unknown"
                if half is not None:  # nothing applied anywhere: not the requester's failure, no strike
                    withdrawn, outcome = self._abort((peer, xid), now), "abort"
            elif not streaming:
                half = self._pending.pop((peer, xid), None)
                if half is None:
                    outcome = "unknown"
                else:
                    outcome = "commit"
                    self._paused.pop(peer, None)
                    self._confirm_took[peer] = (now - half.received, now)
                    self._committed.append(half)
                    self._decide(peer, xid, outcome, now)
                    unacked = self._unacked.setdefault(peer, OrderedDict())
                    unacked[xid] = now
                    while len(unacked) > KNOWN_PER_PEER:
                        unacked.popitem(last=False)
                    self.committed.set()
        if withdrawn is not None:
            withdrawn.release()
            self._counters.add("exchanges_withdrawn")
        elif streaming:  # nothing decided: its snapshot is still coming in (it expires like any pending one)
            raise refused("streaming", f"your snapshot for exchange {xid} is still streaming in; confirm again")
        self._counters.add(f"exchanges_decided.{outcome}")
        return Reply(encode(DECISION, request.header.id, xid=xid, outcome=outcome))

    def serve_ack(self, request: Request) -> Reply:
        peer, xid = request.sender, request.header["xid"]
        with self._lock:
            self._held_up_to(peer, xid)
            known = self._decisions.get(peer, {}).get(xid)
        return Reply(encode(DECISION, request.header.id, xid=xid, outcome=known[0] if known else "unknown"))

    def _decide(self, peer: str, xid: int, outcome: str, now: float) -> None:
        table = self._decisions.setdefault(peer, OrderedDict())
        table[xid] = (outcome, now)
        while len(table) > DECISIONS_PER_PEER or (table and now - next(iter(table.values()))[1] > DECISION_RETENTION_S):
            table.popitem(last=False)

    def _expire(self, now: float, everything: bool = False) -> None:
        """Abort the pending exchanges past their time (`everything`: all of them); forget old acks."""
        # a requester gives up asking after RESOLVE_LIMIT_S: nobody waits for an ack longer
        for table in self._unacked.values():
            for xid in [x for x, t in table.items() if now - t > RESOLVE_LIMIT_S]:
                del table[xid]
        for key in [k for k, half in self._pending.items() if everything or now >= half.expires]:
            self._abort(key, now).release()
            self._counters.add("exchanges_expired")
            if not everything:  # its requester did not confirm in time
                self._strike(key[0], now, key[1])

    def _strike(self, peer: str, now: float, unconfirmed: int = 0) -> None:
        """(With the lock held) an exchange `peer` asked for failed on its side (not confirmed in time, or its
        snapshot did not stream in): after a few in a row, it waits to be served again, longer each time.
        `unconfirmed`: the exchange's xid when it was not confirmed in time; a confirm that still comes takes
        the strike back (:meth:`_late`)."""
        if unconfirmed:
            self._unconfirmed[(peer, unconfirmed)] = None
            while len(self._unconfirmed) > UNCONFIRMED_KEPT:
                self._unconfirmed.popitem(last=False)
        self._failed_at[peer] = now
        _, pause, strikes = self._paused.get(peer, (0.0, 0.0, 0))
        strikes += 1
        if strikes >= EXPIRIES_BEFORE_PAUSE:
            pause = min(RESOLVE_LIMIT_S, max(self.ttl_s, 2 * pause))
        self._paused[peer] = (now + pause if strikes >= EXPIRIES_BEFORE_PAUSE else 0.0, pause, strikes)

    def forget(self, peer: str) -> None:
        """`peer` left the view or restarted: its strikes and pause were its predecessor's, and go with it (a
        node killed in the middle of exchanges would otherwise leave its restart refused busy for up to
        RESOLVE_LIMIT_S)."""
        with self._lock:
            self._paused.pop(peer, None)
            self._failed_at.pop(peer, None)

    def _late(self, peer: str, xid: int) -> None:
        """(With the lock held) the confirm of `xid`, which expired (or gave way) unconfirmed, came after all:
        its requester is on a slow link, not hostile. The strike is taken back, and with it a pause it led to;
        the exchange stays aborted, and the requester stays one whose exchanges give way to others' at once
        for a while (FAILURE_MEMORY_S), so a requester that always confirms late still costs others little."""
        if (peer, xid) not in self._unconfirmed:
            return  # not one that struck (or already taken back: a repeated confirm)
        del self._unconfirmed[(peer, xid)]
        until, pause, strikes = self._paused.get(peer, (0.0, 0.0, 0))
        strikes = max(0, strikes - 1)
        self._paused[peer] = (until if strikes >= EXPIRIES_BEFORE_PAUSE else 0.0, pause, strikes)
        self._counters.add("exchanges_confirmed_late")

    def _abort(self, key: tuple[str, int], now: float) -> ServerHalf:
        """(With the lock held) decide abort for the pending exchange `key`; its half, for the caller to
        release. Never applied, so its snapshot may serve another exchange."""
        half = self._pending.pop(key)
        self._admission.give_back()
        self._decide(key[0], key[1], "abort", now)
        return half

    # ----------------------------------------------------------------- training thread

    def take_committed(self) -> list[ServerHalf]:
        """The committed halves, now owned by the caller (who applies them, calls :meth:`applied`, then
        releases them)."""
        with self._lock:
            self._expire(time.monotonic())
            committed, self._committed = self._committed, []
        return committed

    def applied(self) -> None:
        """(Training thread) A committed half we served is applied: our snapshots so far are stale."""
        with self._lock:
            self._settle()

    def pending(self) -> int:
        """Exchanges served and not yet decided."""
        with self._lock:
            self._expire(time.monotonic())
            return len(self._pending)

    def spent(self) -> bool:
        """Has the current snapshot taken part in an applied exchange, with nothing unsettled?

        A node that makes no steps (lingering, at a barrier) publishes a fresh
        snapshot then, or it would answer busy to everyone. Not before what is
        unsettled settles (:mod:`dpwa.mixing.admission`).
        """
        current = self._store.current()
        with self._lock:
            self._expire(time.monotonic())
            return current is not None and self._admission.spent(current.version)

    def held(self) -> int:
        """Requester snapshots held: pending and committed-not-applied."""
        with self._lock:
            return len(self._pending) + len(self._committed)

    def start_closing(self) -> None:
        """Refuse new exchanges from now on; confirms are still answered."""
        with self._lock:
            self._closing = True

    def stop_committing(self) -> None:
        """Commit nothing more: what is pending is aborted now, and so is any later confirm of it."""
        with self._lock:
            self._frozen = True
            self._expire(time.monotonic(), everything=True)

    def unacknowledged(self) -> list[tuple[str, int]]:
        """Commits whose requester is not yet known to hold them (peer, xid)."""
        with self._lock:
            self._expire(time.monotonic())
            return [(peer, xid) for peer, table in self._unacked.items() for xid in table]

    def acknowledged(self, peer: str, xids: Sequence[int]) -> None:
        """`peer` holds these commits of ours (it said so when asked)."""
        with self._lock:
            for xid in xids:
                self._held_up_to(peer, xid)

    def _held_up_to(self, peer: str, xid: int) -> None:
        """(With the lock held) `peer` holds our commit `xid`, so it holds every earlier commit with us too: a
        requester starts nothing while it is in doubt (dpwa.mixing.admission), so it learned each decision
        before it started the next exchange. Those need no answer from us any more."""
        table = self._unacked.get(peer)
        if table is None or xid not in table:
            return
        while table:
            first, _ = table.popitem(last=False)
            if first == xid:
                return

    def close(self) -> None:
        """Abort what is still pending (the Rx thread has stopped: no confirm can come)."""
        self._closed.set()  # a requester's snapshot still streaming in stops
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
            committed, self._committed = self._committed, []
        for half in pending + committed:
            half.release()
        for slots in self._slots.values():
            slots.close()
        if committed:
            logger.error("dpwa: %d committed exchange halves were not applied before close", len(committed))


class AckQueries:
    """A closing server asks each requester whether it holds the commits it has not acknowledged (training
    thread): one ``known`` request per peer at a time, at most every :data:`QUERY_INTERVAL_S`."""

    def __init__(
        self, server: ExchangeServer, submit: Callable[[Any], Call], name: str, deadline: Callable[[], float]
    ) -> None:
        self._server, self._submit, self._name, self._deadline = server, submit, name, deadline
        self._calls: dict[str, Call] = {}
        self._next: dict[str, float] = {}

    def tend(self) -> None:
        now = time.monotonic()
        for peer, call in list(self._calls.items()):
            if call.done.is_set():
                del self._calls[peer]
                if call.outcome == "ok":
                    self._server.acknowledged(peer, call.take())
        asked: dict[str, list[int]] = {}
        for peer, xid in self._server.unacknowledged():
            asked.setdefault(peer, []).append(xid)
        for peer, xids in asked.items():
            if peer not in self._calls and now >= self._next.get(peer, 0.0):
                self._next[peer] = now + QUERY_INTERVAL_S
                self._calls[peer] = self._submit(KnownTask(peer, self._deadline(), self._name, xids))

    def close(self) -> None:
        for call in self._calls.values():
            call.abandon()
        self._calls.clear()
