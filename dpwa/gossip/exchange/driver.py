"""Symmetric exchanges (``mode: symmetric``): the driver of the protocol, with its sockets, threads and clock.

The protocol itself (both halves' states, the one commit decision, expiry,
preemption, the pause after failed exchanges, exchanges in doubt, settling at
close) and its guarantee, each exchange applied on both sides exactly once or
on neither, live in :mod:`dpwa.gossip.exchange.machine`, which holds no
socket, thread or clock and is tested by a deterministic simulation
(``tests/test_exchange_sim.py``). This module drives it: the requests and
replies (:class:`ExchangeTask` and the small tasks on the client thread; the
server's routes on the Rx thread), the snapshots and their slots, streams and
leases (a half: :class:`ClientHalf`, :class:`ServerHalf`), the locks, and
``time.monotonic()``, which it reads and hands to the machine with every event.
"""

from __future__ import annotations

import contextlib
import functools
import random
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...backoff import Backoff
from ...logs import logger
from ...mixing import rules
from ...stats import Counters
from ...wire.bulk import BulkError
from ...wire.calls import Ask, Call, Response
from ...wire.errors import DeadlinePassed, ProtocolError, Refused, RequestTimeout, TransportError, refused
from ...wire.schema import MAX_ID, encode
from ...wire.server import Reply, Request, Route
from ...wire.shm import PeerSlots
from ..membership.deadlines import CAP_FACTOR, Deadlines
from ..transfer.protocol import (
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
from ..transfer.requesting import Arrivals, Received, ReplyReader
from ..transfer.serving import Serving
from ..transfer.snapshots import Lease
from ..transfer.validation import PeerValues
from .machine import DECISIONS_PER_PEER as DECISIONS_PER_PEER  # where callers have long found it
from .machine import (
    RESOLVE_LIMIT_S,
    TTL_MARGIN_S,
    AckQuerySchedule,
    Dropped,
    KnownTable,
    RequesterMachine,
    ServerMachine,
    check_reply,
    decision_applies,
    wait_s,
)
from .machine import SETTLE_QUIET_S as SETTLE_QUIET_S

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

    def __init__(self, peer: str, xid: int, f: float, served: Lease, theirs: Received | None) -> None:
        super().__init__(peer, xid, f)
        self.served = self._stack.enter_context(served)
        self._theirs = self._stack.enter_context(theirs) if theirs is not None else None

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

_EXACT = random.Random(0)  # the short pauses' back-offs have no jitter: a Random of their own would cost a seeding


class ExchangeTask:
    """One exchange, on the client thread. Its value is a ClientHalf (committed) or an InDoubt.

    `peers` are the candidates, best first: a peer that answers ``busy`` (its
    snapshot already serves an exchange) is skipped for the next; when all are
    busy they are asked again after a short pause, for at most `busy_budget_s`.
    ``took_s`` is the time from the request the partner answered to its decision (the exchange's own time,
    without the busy answers before it): the sample its deadline follows (dpwa.gossip.membership.deadlines).
    ``task.peer`` is the peer of the exchange in the end. The task owns `own`
    (our published snapshot) from construction: it goes into the half, or is
    released when the exchange ends without one.
    """

    timed = "exchange"  # its deadline follows the link (dpwa.gossip.membership.deadlines)

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
        slot_to: Callable[[str], bool] = lambda peer: False,
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
        self._slot, self._slot_to = slot, slot_to  # slot_to: does this peer read our slot (dpwa.gossip.transfer.paths)
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
            expected = self._factor((snap.clock, snap.loss), (header["clock"], header["loss"]))
            failed = check_reply(xid, f, expected, time.monotonic(), self.deadline, self._min_confirm_s)
            if failed is not None:
                raise RequestTimeout(failed[1]) if failed[0] == "timeout" else ProtocolError(*failed)
            name = self._fields(self.peer)["from"]
            if not self._confirms():  # our node serves this peer's crossing request: take ours back
                self._withdraw_exchange(ask, name, xid)
                raise refused("aborted", f"this node served {self.peer}'s crossing exchange instead")
            cleanup.pop_all()
        half = ClientHalf(self.peer, xid, f, self._own, theirs)
        pauses = Backoff(0.001, 0.016, rng=_EXACT)
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
                if exc.reason == "streaming" and time.monotonic() + pauses.peek() < self.deadline:
                    time.sleep(pauses.next())  # a bounded wait, on the Tx thread
                    continue
                return InDoubt(half, answered=True)
            except ProtocolError:
                return InDoubt(half, answered=True)
            break
        outcome = decision.header["outcome"]
        if decision.header["xid"] != xid:
            return InDoubt(half, answered=True)  # a confused peer: ask again later
        self.took_s = time.monotonic() - self._asked_at
        if decision_applies(outcome):
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
        pauses = Backoff(0.001, 0.008, rng=_EXACT)
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
                    if how == "slot" and (self._slot is None or not self._slot_to(peer)):
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
            if time.monotonic() + pauses.peek() >= give_up:
                raise refused("busy", f"every peer asked is busy ({', '.join(self._peers)})")
            time.sleep(pauses.next())  # a bounded retry: a busy peer publishes a fresh snapshot at its next step


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

    timed = "confirm"  # its deadline follows the link (dpwa.gossip.membership.deadlines)

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
    """The commits a requester holds (applied), per server peer: the latest few (a
    :class:`~dpwa.gossip.exchange.machine.KnownTable` under a lock). Thread-safe.

    The training thread records them; the Rx thread answers a closing server's ``known`` from them.
    """

    def __init__(self, peers: list[str]) -> None:
        self._lock = threading.Lock()
        self._table = KnownTable(peers)

    def record(self, peer: str, xid: int) -> None:
        with self._lock:
            self._table.record(peer, xid, time.monotonic())

    def latest(self, within_s: float) -> dict[str, int]:
        """Each peer's latest commit we hold, if it is younger than `within_s`."""
        with self._lock:
            return self._table.latest(within_s, time.monotonic())

    def routes(self) -> dict[str, Route]:
        return {KNOWN.name: Route(KNOWN, self.serve)}

    def serve(self, request: Request) -> Reply:
        with self._lock:
            held = self._table.held(request.sender, request.header["xids"])
        return Reply(encode(KNOWN_REPLY, request.header.id, xids=held))


class ExchangeClient:
    """The requester's exchanges in doubt, and their resolution (training thread only): the driver of a
    :class:`~dpwa.gossip.exchange.machine.RequesterMachine`, which says when to ask and when to give up.

    Args:
        name: this node.
        peers: the nodes we may exchange with.
        timeout_s: the deadline of one resolve request.
        submit: runs a task on the client thread.
        counters: where to count committed, aborted and dropped exchanges.
        heard: called with a peer that answered (flow control: it is alive).
        ended: called when an exchange in doubt ends with nothing applied here (aborted, unknown, dropped).
        deadlines: each peer's deadlines, which follow its link (dpwa.gossip.membership.deadlines): a resolve request is
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
        self._machine: RequesterMachine[ClientHalf] = RequesterMachine(counters.add)
        self._calls: dict[tuple[str, int], Call] = {}  # the resolve request on its way, per exchange in doubt
        self.known = KnownCommits(list(peers))
        self._acks: list[tuple[AckTask, Call, int]] = []  # a closing node's acks on their way (task, call, tries)

    def __len__(self) -> int:
        return len(self._machine)

    def blocked_peers(self) -> frozenset[str]:
        """Peers we are in doubt with: no new exchange with them until their decision arrives."""
        return self._machine.blocked_peers()

    def can_start(self) -> bool:
        """May a new exchange start? Not while MAX_IN_DOUBT are in doubt (and not with a peer in blocked_peers)."""
        return self._machine.can_start()

    def add(self, doubt: InDoubt) -> None:
        self._machine.add(doubt.half.peer, doubt.half.xid, doubt.half, time.monotonic())

    def hold(self, half: ClientHalf) -> None:
        """We hold (have applied) `half`'s commit: a closing peer that asks learns it."""
        self.known.record(half.peer, half.xid)
        if self._machine.holds():
            self._ack(half.peer, half.xid)

    def send_acks(self) -> None:
        """Closing: tell each peer we hold its latest commit, so a closing peer need not wait or ask (and each
        commit learned from now on, as it is held)."""
        for peer, xid in self._machine.acks_to_send(self.known.latest(RESOLVE_LIMIT_S)):
            self._ack(peer, xid)

    def _ack(self, peer: str, xid: int, tries: int = 1) -> None:
        task = AckTask(peer, self.closing_deadline(), self.name, xid)
        self._acks.append((task, self._submit(task), tries))

    def closing_deadline(self) -> float:
        """The deadline of a request a closing node queues now: one request's time from when the acks queued
        before it are over. The client thread sends one after another, and a request behind an ack to a peer
        that already closed (which waits its whole deadline) must not expire unsent."""
        return time.monotonic() + self._timeout_s * (1 + sum(not call.done.is_set() for _, call, _ in self._acks))

    def acks_pending(self) -> int:
        return len(self._acks)

    def _tend_acks(self) -> None:
        done = [(task, tries) for task, call, tries in self._acks if call.done.is_set() and _lost(call)]
        self._acks = [entry for entry in self._acks if not entry[1].done.is_set()]
        for task, tries in done:
            if self._machine.ack_again(tries):
                self._ack(task.peer, task.xid, tries + 1)
            else:
                self._counters.add("acks_lost")  # that peer may ask us instead (known), or wait out its close

    def poll(self) -> list[ClientHalf]:
        """Collect decisions; returns the halves now known committed (the caller applies, then acknowledges them)."""
        self._tend_acks()
        now = time.monotonic()
        ready = []
        for (peer, xid), call in list(self._calls.items()):
            if not call.done.is_set():
                continue
            del self._calls[(peer, xid)]
            if call.outcome in ("ok", "refused", "rejected"):
                self._heard(peer)
            if self._deadlines is not None and call.outcome == "ok" and call.latency_s is not None:
                self._deadlines.sample(peer, ResolveTask.timed, call.latency_s)
            elif self._deadlines is not None and call.outcome == "timeout":
                self._deadlines.timed_out(peer, ResolveTask.timed)
            half = self._machine.answered(peer, xid, call.take() if call.outcome == "ok" else None, now)
            if half is not None:
                ready.append(half)
        self._let_go()
        asks, dropped = self._machine.due(now)
        for peer, xid in asks:
            wait_s = self._timeout_s
            if self._deadlines is not None:
                wait_s = self._deadlines.deadline_s(peer, ResolveTask.timed)
            self._calls[(peer, xid)] = self._submit(ResolveTask(peer, now + wait_s, self.name, xid))
        self._dropped(dropped)
        return ready

    def _let_go(self) -> None:
        """The halves the machine says ended unapplied (aborted, unknown): let go, and our node may serve."""
        for half in self._machine.take_released():
            half.release()
            self._ended()

    def forget_gone(self, members: Collection[str]) -> None:
        """(Open membership) A peer removed from the view will not answer: an exchange in doubt with it is
        dropped now (logged), not after RESOLVE_LIMIT_S, in which no exchange of ours could start."""
        self._dropped(self._machine.forget_gone(members))

    def _dropped(self, dropped: list[Dropped[ClientHalf]]) -> None:
        for gone in dropped:
            call = self._calls.pop((gone.peer, gone.xid), None)
            if call is not None:
                call.abandon()
            gone.half.release()
            self._ended()
            logger.warning(
                "%s: gave up on exchange %d with %s: %s; if the peer committed it, "
                "the nodes' mean moved by that exchange's correction",
                self.name,
                gone.xid,
                gone.peer,
                gone.why,
            )

    def close(self) -> None:
        """Drop whatever is still in doubt (logged): the peer never answered within the settle time."""
        self._dropped(self._machine.close())
        for _, call, _ in self._acks:
            call.abandon()
        self._acks.clear()


def _lost(call: Call) -> bool:
    """Did a request fail on the way (so it may be sent again), rather than be answered?"""
    return call.outcome in ("timeout", "failed", "expired")


# --------------------------------------------------------------------------- server


class _Locked:
    """``with`` it: the server's machine under its lock, and the halves the machine let go of meanwhile
    released on the way out (a class, not a generator: it is entered a dozen times an exchange)."""

    __slots__ = ("_lock", "_machine")

    def __init__(self, lock: threading.Lock, machine: ServerMachine[ServerHalf]) -> None:
        self._lock, self._machine = lock, machine

    def __enter__(self) -> ServerMachine[ServerHalf]:
        self._lock.acquire()
        return self._machine

    def __exit__(self, *exc: object) -> None:
        try:
            for half in self._machine.take_released():
                half.release()
        finally:
            self._lock.release()


class ExchangeServer:
    """The server half: serves exchanges and answers confirms (Rx thread), hands committed ones over (training
    thread). The driver of a :class:`~dpwa.gossip.exchange.machine.ServerMachine`, which decides; this class
    holds the snapshots, reads the requests, answers them, and calls the machine under its lock.

    Args:
        name: this node (crossing exchanges are settled by name: see ServerMachine._give_way).
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
        # requester snapshots that came in chunks (or encoded): received into our slot nobody holds, if any
        self._arrivals = Arrivals(serving.model, spare=serving.store.borrow)
        self._counters = counters
        self._lock = threading.Lock()
        self._machine: ServerMachine[ServerHalf] = ServerMachine(name, self.ttl_s, counters.add)
        self._guard = _Locked(self._lock, self._machine)
        self.committed = threading.Event()  # set when an exchange commits (a lingering node waits on it)

    def _locked(self) -> _Locked:
        """The machine, under the lock; the halves it let go of meanwhile are released on the way out."""
        return self._guard

    @property
    def last_confirm(self) -> float:
        """time.monotonic() of the last confirm received."""
        return self._machine.last_confirm

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
        if self._streams_in is None or self._streams_in[1].paths.host(request.sender) is None:
            raise ProtocolError(
                "bulk_unavailable", f"this node reads no bulk streams from {request.sender}; send the payload"
            )
        return self._serve(request, None)

    def _streamed(self, peer: str, xid: int, theirs: Received | None, why: str) -> None:
        """(The stream thread) the requester's snapshot of exchange `xid` is in and checked, or failed."""
        failed = False
        with self._locked() as machine:
            half = machine.half(peer, xid)
            if machine.streamed(peer, xid, theirs is not None, time.monotonic()):
                if theirs is None:
                    failed = True  # nothing can commit: the machine aborted it
                elif half is not None:
                    half.attach(theirs)
                    theirs = None
        if theirs is not None:
            theirs.release()  # the exchange expired (or the node closed) while it streamed in
        if failed:
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
            wait = wait_s(header.get("wait_ms"), self._wait_floor_s, self._wait_cap_s)
            half = ServerHalf(peer, xid, f, served, theirs)
            reply = self._serving.reply(request, half.served.share(), xid=xid, f=f)
            undo.pop_all()
        with self._locked() as machine:
            machine.hold(peer, xid, half, received=now, expires=now + wait + TTL_MARGIN_S, arrived=half.arrived)
        self._counters.add("exchanges_served")
        if receive is None:
            assert self._streams_in is not None
            submit, reader = self._streams_in
            done = functools.partial(self._streamed, peer, xid)

            def cancelled() -> bool:  # closing, or the exchange is over (aborted, preempted, expired)
                return self._closed.is_set() or not self._machine.is_pending(peer, xid)

            submit(StreamInTask(peer, now + wait, header, reader, done, cancelled))
            self._counters.add("bulk_exchanges_served")
        return reply

    def _reserve(self, peer: str) -> Lease:
        with self._locked() as machine:
            now = time.monotonic()
            refusal = machine.refusal(peer, now)
            if refusal is not None:
                raise refused(*refusal)
            served = self._store.lease()
            if served is None:
                raise refused(*self._store.refusal())
            why = machine.admit(peer, served.snapshot.version, now)
            if why:
                served.release()
                raise refused("busy", why)
            return served

    def _unreserve(self) -> None:
        with self._locked() as machine:
            machine.unreserve()

    # ----------------------------------------------------------------- this node's own exchanges

    def take_own(self, version: int) -> int:
        """(Training thread) May our own exchange start on snapshot `version`? If so (a ticket > 0) it is our
        one unsettled exchange until :meth:`own_ended` with that ticket."""
        with self._locked() as machine:
            return machine.take_own(version, time.monotonic())

    def own_asks(self, ticket: int, peer: str) -> bool:
        """(Tx thread) Our own exchange `ticket` is about to ask `peer`: False if it is over (it gave way to a
        crossing request: ask nobody)."""
        with self._locked() as machine:
            return machine.own_asks(ticket, peer)

    def own_confirms(self, ticket: int) -> bool:
        """(Tx thread) Our own exchange `ticket` had its reply and is about to confirm: False if it gave way
        meanwhile (withdraw it instead); True, and from now on it gives way to nobody."""
        with self._locked() as machine:
            return machine.own_confirms(ticket)

    def own_ended(self, ticket: int, applied: bool) -> None:
        """Our own exchange `ticket` is over: its half `applied` (training thread), or nothing applied on
        either side (any thread, as soon as that is known; again later, harmlessly)."""
        with self._locked() as machine:
            machine.own_ended(ticket, applied, self._published())

    def _published(self) -> int:
        current = self._store.current()
        return current.version if current is not None else 0

    def serve_confirm(self, request: Request) -> Reply:
        """A requester's confirm (commit, if still pending), or its withdrawal (``withdraw``: abort it; it
        gave way to a crossing exchange and applies nothing). Either is answered with the decision."""
        peer, xid = request.sender, request.header["xid"]
        with self._locked() as machine:
            outcome, committed = machine.confirm(peer, xid, bool(request.header.get("withdraw")), time.monotonic())
        if committed:
            self.committed.set()
        if outcome == "streaming":  # nothing decided: its snapshot is still coming in (it expires like any other)
            raise refused("streaming", f"your snapshot for exchange {xid} is still streaming in; confirm again")
        return Reply(encode(DECISION, request.header.id, xid=xid, outcome=outcome))

    def serve_ack(self, request: Request) -> Reply:
        with self._locked() as machine:
            outcome = machine.ack(request.sender, request.header["xid"])
        return Reply(encode(DECISION, request.header.id, xid=request.header["xid"], outcome=outcome))

    def forget(self, peer: str) -> None:
        """`peer` left the view or restarted: its strikes and pause were its predecessor's, and go with it."""
        with self._locked() as machine:
            machine.forget(peer)

    # ----------------------------------------------------------------- training thread

    def take_committed(self) -> list[ServerHalf]:
        """The committed halves, now owned by the caller (who applies them, calls :meth:`applied`, then
        releases them)."""
        with self._locked() as machine:
            return machine.take_committed(time.monotonic())

    def applied(self) -> None:
        """(Training thread) A committed half we served is applied: our snapshots so far are stale."""
        with self._locked() as machine:
            machine.applied(self._published())

    def pending(self) -> int:
        """Exchanges served and not yet decided."""
        with self._locked() as machine:
            return machine.pending(time.monotonic())

    def spent(self) -> bool:
        """Has the current snapshot taken part in an applied exchange, with nothing unsettled?

        A node that makes no steps (lingering, at a barrier) publishes a fresh
        snapshot then, or it would answer busy to everyone. Not before what is
        unsettled settles (:mod:`dpwa.mixing.admission`).
        """
        current = self._store.current()
        with self._locked() as machine:
            return current is not None and machine.spent(current.version, time.monotonic())

    def held(self) -> int:
        """Requester snapshots held: pending and committed-not-applied."""
        with self._locked() as machine:
            return machine.held()

    def start_closing(self) -> None:
        """Refuse new exchanges from now on; confirms are still answered."""
        with self._locked() as machine:
            machine.start_closing()

    def stop_committing(self) -> None:
        """Commit nothing more: what is pending is aborted now, and so is any later confirm of it."""
        with self._locked() as machine:
            machine.stop_committing(time.monotonic())

    def unacknowledged(self) -> list[tuple[str, int]]:
        """Commits whose requester is not yet known to hold them (peer, xid)."""
        with self._locked() as machine:
            return machine.unacknowledged(time.monotonic())

    def acknowledged(self, peer: str, xids: Sequence[int]) -> None:
        """`peer` holds these commits of ours (it said so when asked)."""
        with self._locked() as machine:
            machine.acknowledged(peer, xids)

    def close(self) -> None:
        """Abort what is still pending (the Rx thread has stopped: no confirm can come)."""
        self._closed.set()  # a requester's snapshot still streaming in stops
        with self._lock:
            halves, committed = self._machine.close()
        for half in halves:
            half.release()
        for slots in self._slots.values():
            slots.close()
        if committed:
            logger.error("dpwa: %d committed exchange halves were not applied before close", committed)


class AckQueries:
    """A closing server asks each requester whether it holds the commits it has not acknowledged (training
    thread): one ``known`` request per peer at a time, at most every QUERY_INTERVAL_S (the machine's
    :class:`~dpwa.gossip.exchange.machine.AckQuerySchedule`)."""

    def __init__(
        self, server: ExchangeServer, submit: Callable[[Any], Call], name: str, deadline: Callable[[], float]
    ) -> None:
        self._server, self._submit, self._name, self._deadline = server, submit, name, deadline
        self._calls: dict[str, Call] = {}
        self._schedule = AckQuerySchedule()

    def ask_due(self) -> None:
        for peer, call in list(self._calls.items()):
            if call.done.is_set():
                del self._calls[peer]
                if call.outcome == "ok":
                    self._server.acknowledged(peer, call.take())
        due = self._schedule.due(self._server.unacknowledged(), self._calls, time.monotonic())
        for peer, xids in due.items():
            self._calls[peer] = self._submit(KnownTask(peer, self._deadline(), self._name, xids))

    def close(self) -> None:
        for call in self._calls.values():
            call.abandon()
        self._calls.clear()
