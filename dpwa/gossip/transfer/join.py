"""Joining: a node that starts late, or restarts after a crash, takes the cluster's state from a peer.

With ``join: auto`` (the default) a starting node asks its peers for a
*join offer* before its constructor returns:

* if a peer has trained already (its clock > 0), the node joins from a
  healthy peer with the freshest clock (among those within 10% of the
  freshest, in a random order weighted by score, so several joiners spread
  over donors; the other trained peers, freshest first, if those fail), and
  takes its parameters, floating-point buffers, clock and barrier counters,
  and its optimizer state when both sides have one;
* if every node is at clock 0 (a fresh start), every node but the first of
  the config takes the first node's initial parameters, as DDP broadcasts
  rank 0's; when that node does not answer in time, the node says so and
  keeps its own.

What was taken is a :class:`Joined`; its ``rejoined`` tells the first case
(True) from the second (False).

A donor never pauses. Its offer's parameters are its latest published
snapshot (leased: no copy, and no wait for its training thread); its
optimizer state, which only the training thread may read, is copied at its
next step (or at once while it waits at a barrier or lingers) and paired
with the snapshot published then. An offer costs the donor one hash of the
state, so it makes at most one every :data:`OFFER_INTERVAL_S` (a fresh one
serves every joiner meanwhile), and only a peer of the config may ask. A
donor keeps at most :data:`MAX_OFFERS` offers, each for :data:`OFFER_TTL_S`
after its last use, or :data:`OFFER_DONE_S` after its last chunk was served,
or until every joiner it was given to says ``join_done`` (it holds the state,
checked): an offer holds a snapshot slot, and the donor's averaging needs it.

The joiner takes nothing on faith. Before it allocates anything it checks
the offer's sizes against its own: the parameters' exactly, the optimizer
state's at most :meth:`ExtraState.budget` (none when it has no optimizer:
it asks for parameters only). It reads the offer in chunks of
:data:`CHUNK_BYTES`, checks a BLAKE2b hash of the whole state, the
parameters' values, and every field of the optimizer state against its own
optimizer (:meth:`ExtraState.check`) before using any of it. A donor that
answers ``busy`` is asked again with back-off; one that fails, dies or lies
mid-transfer is logged with the field at fault and the next donor is tried;
when every donor failed, the peers are asked again, within the join's time.
The donor's barrier counts are adopted only up to what the other peers
report (:func:`dpwa.gossip.membership.barrier.plausible`).

The optimizer state travels as msgpack metadata (numbers, names, tensor
layouts) plus raw tensor bytes: never pickle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import threading
import time
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...backoff import Backoff
from ...logs import logger
from ...mixing import kernels
from ...mixing.model import WireModel
from ...wire.calls import Ask
from ...wire.errors import ProtocolError, Refused, TransportError, refused
from ...wire.schema import MAX_ID, NAME_PATTERN, Blob, Choice, Flag, Integer, Text, encode, message_kind
from ...wire.server import Reply, Request, Route
from ..membership.barrier import COUNTS, BarrierCounts
from .protocol import CLOCK, DTYPE, FINGERPRINT, MAX_VALUE, STATES, NodeState
from .snapshots import Lease, SnapshotStore

__all__ = [
    "CHUNK_BYTES",
    "ExtraState",
    "JoinServer",
    "JoinTask",
    "JoinTerms",
    "Joined",
    "OfferInfo",
    "OfferTask",
]

CHUNK_BYTES = 4 << 20  # bytes of state per join_data reply
MAX_OFFERS = 2  # offers a donor keeps at once (each a copy of the model and its optimizer state)
OFFER_TTL_S = 30.0  # an offer is dropped this long after its last use
# ... or this long, once its last chunk was served (a joiner that read it all is done), or at once when every joiner
# it was given to said join_done. An offer holds a snapshot slot: two offers held both of a node's slots, and froze
# its averaging, for 30 s after each restart of a peer (the relay walkthrough's restarts); held 2 s after a
# torchrun start's join, the donor's publishes were skipped and its exchanges missed 4 or 5 steps of 144
OFFER_DONE_S = 2.0
EXTRA_PATIENCE_S = 2.0  # a joiner waits this long for a donor's optimizer state, then takes its parameters alone
MAX_EXTRA_META = 60_000  # bytes of optimizer-state metadata
OFFER_INTERVAL_S = 1.0  # a donor makes at most one new offer this often (each hashes the whole state)
BUSY_RETRY_MAX_S = 1.0  # a donor that answers busy is asked again after 50 ms, doubling up to this
JOIN_ROUNDS = 3  # times a joiner asks its peers for offers, when every donor of the last round failed

_NAME = Text(64, NAME_PATTERN)
_SESSION = Integer(1, MAX_ID)
# `offer`: make an offer (absent: do), else only say where we are (clock, barriers, state: cheap);
# `extra`: the joiner takes an optimizer state too (absent: it does)
JOIN_INFO = message_kind("join_info", {"from": _NAME}, {"offer": Flag(), "extra": Flag()})
JOIN_OFFER = message_kind(
    "join_offer",
    {"clock": CLOCK, "barriers": COUNTS, "yours": COUNTS, "state": Choice(STATES), "ready": Flag()},
    {
        "session": _SESSION,
        "fp": FINGERPRINT,
        "dtype": DTYPE,
        "params_bytes": Integer(0, 1 << 40),
        "nbytes": Integer(0, 1 << 40),
        "digest": Blob(length=32),
        "extra": Blob(max_len=MAX_EXTRA_META),
    },
    max_header_bytes=1 << 16,
)
JOIN_CHUNK = message_kind("join_chunk", {"from": _NAME, "session": _SESSION, "offset": Integer(0, 1 << 40)})
JOIN_DATA = message_kind("join_data", {"session": _SESSION, "offset": Integer(0, 1 << 40)}, payload=1)
# the joiner took the offer's state whole and checked it: the donor lets the offer go (the reply echoes it)
JOIN_DONE = message_kind("join_done", {"from": _NAME, "session": _SESSION})


class ExtraState(Protocol):
    """State beside the parameters that a joiner takes too (an optimizer's momentum, say)."""

    def capture(self) -> tuple[bytes, np.ndarray]:
        """(metadata, raw bytes as a uint8 array) of the current state; metadata at most MAX_EXTRA_META bytes."""

    def budget(self) -> int:
        """The most bytes of such state this node takes from a donor (0: none)."""

    def check(self, meta: bytes, data: np.ndarray) -> Any:
        """A state captured by a peer's capture(), checked against ours (any thread; changes nothing).

        Returns it ready for :meth:`load`; raises ValueError naming the field that does not fit.
        """

    def load(self, checked: Any) -> None:
        """Take over a state :meth:`check` returned (the training thread)."""


@dataclass(eq=False)
class _Capture:
    """The extra state as the training thread captured it, with the snapshot published just before."""

    lease: Lease
    meta: bytes
    data: np.ndarray  # uint8
    at: float  # when


@dataclass(eq=False)
class _Offer:
    session: int
    snapshot: Lease  # the parameters: a published snapshot, leased while the offer lives
    extra: np.ndarray  # uint8: the extra state's bytes (empty without one)
    extra_meta: bytes
    digest: bytes  # of the snapshot's bytes, then the extra bytes
    created: float
    used: float
    finished: bool = False  # its last chunk was served
    readers: set[str] = field(default_factory=set)  # the joiners it was given to that have not said join_done

    @property
    def nbytes(self) -> int:
        return int(self.snapshot.snapshot.array.nbytes + self.extra.nbytes)

    def chunk(self, offset: int) -> np.ndarray:
        """The bytes at [offset, offset + CHUNK_BYTES): a view, alive as long as the offer (and the reply)."""
        params = self.snapshot.snapshot.array.view(np.uint8)
        if offset < params.nbytes:
            return (
                params[offset : offset + CHUNK_BYTES]
                if offset + CHUNK_BYTES <= params.nbytes
                else np.concatenate([params[offset:], self.extra[: offset + CHUNK_BYTES - params.nbytes]])
            )
        return self.extra[offset - params.nbytes : offset - params.nbytes + CHUNK_BYTES]


class JoinServer:
    """The donor side: answers offers from the Rx thread; captures the extra state on the training thread.

    The parameters of an offer are a published snapshot, leased, so an offer
    never waits for the training thread and costs no copy. The extra state (an
    optimizer's) can only be read on the training thread: asked for it, the
    donor captures it at its next step (or at once while it waits at a
    barrier or lingers), paired with the snapshot published then. A donor that
    makes no step for :data:`EXTRA_PATIENCE_S` (it evaluates, say) offers its
    parameters without it. A joiner that has no optimizer asks for parameters
    only. A new offer hashes the whole state, so one is made at most every
    :data:`OFFER_INTERVAL_S`; meanwhile the newest serves.

    Args:
        name: this node, for the log.
        store: our published snapshots.
        model: what our model looks like on the wire.
        barriers: our barrier counts (and what we know of our peers').
        state: reads the node's state.
        extra: what else a joiner takes (an optimizer), if anything.
        peers: the names that may ask.
    """

    def __init__(
        self,
        name: str,
        store: SnapshotStore,
        model: WireModel,
        barriers: BarrierCounts,
        state: Callable[[], NodeState],
        extra: ExtraState | None,
        peers: list[str] | Container[str],
    ) -> None:
        self._name, self._store, self._model = name, store, model
        self._barriers, self._state, self._extra = barriers, state, extra
        # the config's peers, or (open membership) the view, asked as it is: its members change
        self._peers: Container[str] = frozenset(peers) if isinstance(peers, list) else peers
        self._lock = threading.Lock()
        self._offers: dict[int, _Offer] = {}
        self._made = -float("inf")  # when the newest offer was made
        self._not_before = -float("inf")  # offers and captures older than this are of a state since replaced
        self._captured: _Capture | None = None  # the extra state, and the snapshot it goes with
        self._asked: dict[str, float] = {}  # joiner -> when it first asked for an offer not yet made
        self.wanted = threading.Event()  # a joiner waits for our extra state

    def routes(self) -> dict[str, Route]:
        return {
            JOIN_INFO.name: Route(JOIN_INFO, self.serve_info),
            JOIN_CHUNK.name: Route(JOIN_CHUNK, self.serve_chunk, bulk=True),
            JOIN_DONE.name: Route(JOIN_DONE, self.serve_done),
        }

    # ----------------------------------------------------------------- training thread

    def capture_if_wanted(self) -> None:
        """Capture the extra state for the snapshot just published, if a joiner waits for it."""
        if not self.wanted.is_set() or self._extra is None:
            return
        self.wanted.clear()
        lease = self._store.lease()  # the snapshot just published: held until an offer takes it, so a donor
        if lease is None:  # that steps fast (its next snapshot within the joiner's next ask) still pairs them
            return
        meta, data = self._extra.capture()
        if len(meta) > MAX_EXTRA_META:
            lease.release()
            raise ValueError(f"the extra state's metadata is {len(meta)} bytes, at most {MAX_EXTRA_META}")
        capture = _Capture(lease, meta, np.ascontiguousarray(data).view(np.uint8).reshape(-1), time.monotonic())
        with self._lock:
            old, self._captured = self._captured, capture
        if old is not None:
            old.lease.release()

    def replaced(self) -> None:
        """(training thread) The node's state was replaced (a checkpoint restored, then published): offers
        and a captured extra state made before are stale, and the Rx thread drops them as it meets them."""
        self._made = -float("inf")
        self._not_before = time.monotonic()

    # ----------------------------------------------------------------- Rx thread

    def expire(self) -> None:
        """(training thread, before each publish) Drop the offers nobody uses any more: their slots go back. Without
        offers (all but the seconds of a join) it takes no lock: the Rx thread may hold it to hash a new offer."""
        if not self._offers:  # one read of the dict's size: a stale answer only delays this to the next step
            return
        with self._lock:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        old = [s for s, o in self._offers.items() if now - o.used > (OFFER_DONE_S if o.finished else OFFER_TTL_S)]
        for session in old:
            self._offers.pop(session).snapshot.release()
        for joiner in [j for j, t in self._asked.items() if now - t > OFFER_TTL_S]:
            del self._asked[joiner]

    def _offer_for(self, sender: str, with_extra: bool, now: float) -> _Offer | None:
        """An offer for `sender`: a current (or fresh) one, or a new one if everything it needs is there."""
        current = self._store.current()
        if current is None:
            return None
        asked = self._asked.get(sender)
        patience_over = asked is not None and now - asked > EXTRA_PATIENCE_S
        with_extra = with_extra and self._extra is not None
        for offer in sorted(self._offers.values(), key=lambda o: -o.created):
            if offer.created < self._not_before:
                continue  # of a state since restored: it expires unused
            whole = bool(offer.extra_meta) or patience_over if with_extra else not offer.extra_meta
            recent = now - offer.created < OFFER_INTERVAL_S or (asked is not None and offer.created >= asked)
            if whole and (offer.snapshot.snapshot.version == current.version or recent):
                return offer
        if now - self._made < OFFER_INTERVAL_S:
            return None  # a new offer hashes the whole state: the joiner asks again in a moment
        captured = self._captured if with_extra else None
        if captured is not None and (
            now - captured.at > OFFER_TTL_S or captured.at < self._not_before or asked is None or captured.at < asked
        ):
            # from a joiner long gone or served meanwhile (its patience ran out: parameters only), or of a state
            # since restored: this joiner did not ask for it, and the donor has trained since. Ask afresh
            self._captured = None
            captured.lease.release()
            captured = None
        if with_extra and captured is None and not patience_over:
            return None  # the donor captures it at its next step
        if captured is not None:  # the offer takes over its lease
            self._captured = None
            lease, meta, extra = captured.lease, captured.meta, captured.data
        else:  # parameters only (asked so, or the donor makes no step)
            taken = self._store.lease()
            if taken is None:
                return None
            lease, meta, extra = taken, b"", np.empty(0, np.uint8)
        hasher = hashlib.blake2b(lease.snapshot.array.view(np.uint8).data, digest_size=32)
        params_digest = hasher.hexdigest()
        hasher.update(extra.data)
        offer = _Offer(secrets.randbelow(MAX_ID) + 1, lease, extra, meta, hasher.digest(), now, now)
        self._made = now
        logger.info(  # at most one a second: offers are made no more often
            "%s: offers %s its state: snapshot %d at clock %.0f (parameters blake2b %s), %s, digest %s",
            self._name,
            sender,
            lease.snapshot.version,
            lease.snapshot.clock,
            params_digest,
            "with its optimizer state" if meta else "parameters only",
            offer.digest.hex(),
        )
        while len(self._offers) >= MAX_OFFERS:
            oldest = min(self._offers.values(), key=lambda o: o.used)
            self._offers.pop(oldest.session).snapshot.release()
        self._offers[offer.session] = offer
        return offer

    def serve_info(self, request: Request) -> Reply:
        sender = request.sender
        if sender not in self._peers:
            raise refused("unknown_node", "only a node of this cluster may join from us")
        with_extra = request.header.get("extra", True)
        now = time.monotonic()
        offer = None
        if request.header.get("offer", True):
            with self._lock:
                self._expire(now)
                offer = self._offer_for(sender, with_extra, now)
                if offer is not None:
                    offer.used = now
                    offer.readers.add(sender)
                    self._asked.pop(sender, None)
                else:
                    self._asked.setdefault(sender, now)
            if offer is None and with_extra:
                self.wanted.set()
        current = self._store.current()
        fields: dict[str, Any] = {
            "clock": current.clock if current is not None else 0.0,
            "barriers": self._barriers.offered(),
            "yours": self._barriers.of(sender),
            "state": self._state(),
            "ready": offer is not None,
        }
        if offer is not None:
            snap = offer.snapshot.snapshot
            fields.update(
                session=offer.session,
                fp=self._model.fingerprint,
                dtype=self._model.dtype,
                params_bytes=int(snap.array.nbytes),
                nbytes=offer.nbytes,
                digest=offer.digest,
                extra=offer.extra_meta,
                clock=snap.clock,
            )
        return Reply(encode(JOIN_OFFER, request.header.id, **fields))

    def serve_chunk(self, request: Request) -> Reply:
        header = request.header
        if not request.may_send_payload:
            raise refused("busy", "earlier replies to you are still unsent")
        with self._lock:
            offer = self._offers.get(header["session"])
            if offer is not None:
                offer.used = time.monotonic()
                offer.finished = offer.finished or header["offset"] + CHUNK_BYTES >= offer.nbytes
        if offer is None:
            raise refused("unknown_session", "no such join offer (expired, or never made)")
        offset = header["offset"]
        if offset >= offer.nbytes or offset % CHUNK_BYTES:
            raise ProtocolError("bad_offset", f"offset {offset} is not a chunk of the {offer.nbytes}-byte offer")
        return Reply(encode(JOIN_DATA, header.id, session=offer.session, offset=offset), payload=[offer.chunk(offset)])

    def serve_done(self, request: Request) -> Reply:
        """A joiner took the offer whole: once every joiner it was given to says so, it goes, and its slot back."""
        if request.sender not in self._peers:
            raise refused("unknown_node", "only a node of this cluster may join from us")
        session = request.header["session"]
        with self._lock:
            offer = self._offers.get(session)
            if offer is not None:
                offer.readers.discard(request.sender)
                if not offer.readers:
                    self._offers.pop(session).snapshot.release()
        return Reply(encode(JOIN_DONE, request.header.id, **{"from": self._name}, session=session))

    def close(self) -> None:
        with self._lock:
            for offer in self._offers.values():
                offer.snapshot.release()
            self._offers.clear()
            captured, self._captured = self._captured, None
        if captured is not None:
            captured.lease.release()


# --------------------------------------------------------------------------- joiner


@dataclass(frozen=True)
class JoinTerms:
    """What a joiner takes: a model like ours, and an optimizer state only if it has one that fits."""

    model: WireModel
    extra_budget: int = 0  # the most bytes of optimizer state we take (0: parameters only)
    check_extra: Callable[[bytes, np.ndarray], Any] | None = None  # ExtraState.check

    @property
    def params_bytes(self) -> int:
        return self.model.kept_nbytes  # snapshots travel as kept (int8's in float32): a join is rare

    @property
    def with_extra(self) -> bool:
        return self.extra_budget > 0 and self.check_extra is not None


@dataclass(frozen=True)
class OfferInfo:
    """What a peer said about its state, and its offer when it had one ready."""

    peer: str
    clock: float
    barriers: dict[str, int]
    yours: dict[str, int]
    state: NodeState
    ready: bool
    fields: Mapping[str, Any]


@dataclass(frozen=True, repr=False)
class Joined:
    """A peer's state, received whole and checked.

    ``rejoined`` tells the two kinds of join apart: True when the cluster had
    trained (a peer's clock was above 0: this node started late, or again
    after a crash or a restart, and took the donor's clock and barrier counts
    too); False at a fresh start, where a node takes the first node's initial
    parameters at clock 0 (as DDP broadcasts rank 0's). The repr is short: the
    donor, clock, sizes and the names of the extra state's parts, no arrays.
    """

    donor: str
    clock: float
    barriers: dict[str, int]  # the donor's
    yours: dict[str, int]  # what the donor knew of our counters
    params: np.ndarray  # the donor's published snapshot, in the wire dtype
    extra_meta: bytes
    extra: np.ndarray  # uint8
    digest: bytes
    extra_state: Any = None  # the optimizer state, checked (ExtraState.check), when one came
    reports: tuple[dict[str, int], ...] = ()  # every answering peer's own barrier counts
    rejoined: bool = False  # the cluster had trained: not a fresh start (see the class docstring)

    def __repr__(self) -> str:
        if self.extra_state is None:
            extra = "none"
        elif isinstance(self.extra_state, dict):
            names = ", ".join(f"{name!s:.20}" for name in list(self.extra_state)[:4])
            more = f", +{len(self.extra_state) - 4}" if len(self.extra_state) > 4 else ""
            extra = f"{self.extra.nbytes} bytes [{names}{more}]"
        else:
            extra = f"{self.extra.nbytes} bytes"
        return (
            f"Joined(donor={self.donor!r:.40}, clock={self.clock:g}, rejoined={self.rejoined}, "
            f"params={self.params.size} {self.params.dtype}, extra={extra}, digest={self.digest.hex()[:12]})"
        )


class OfferTask:
    """Ask one peer about its state, and for an offer if `offer` (value: an OfferInfo)."""

    def __init__(self, peer: str, deadline: float, name: str, with_extra: bool = True, offer: bool = True) -> None:
        self.peer, self.deadline, self._name = peer, deadline, name
        self._with_extra, self._offer = with_extra, offer

    def run(self, ask: Ask) -> OfferInfo:
        fields = {"from": self._name, "offer": self._offer, "extra": self._with_extra}
        response = ask(lambda rid: [encode(JOIN_INFO, rid, **fields)], {JOIN_OFFER.name: JOIN_OFFER})
        h = response.header
        return OfferInfo(self.peer, h["clock"], dict(h["barriers"]), dict(h["yours"]), h["state"], h["ready"], h.fields)


class JoinTask:
    """Take one peer's state: wait for its offer, check its sizes, read it in chunks, check it. Value: a Joined."""

    def __init__(self, peer: str, deadline: float, name: str, terms: JoinTerms, request_s: float) -> None:
        self.peer, self.deadline, self._name = peer, deadline, name
        self._terms, self._request_s = terms, request_s

    def run(self, ask: Ask) -> Joined:
        terms = self._terms
        info = None
        backoff = Backoff(0.01, 0.2)  # between polls: 10 ms, doubling up to 0.2 s
        while info is None or not info.ready:  # the donor makes its offer at its next step
            if info is not None:
                if time.monotonic() + backoff.peek() >= self.deadline:
                    raise refused("not_ready", "the donor made no offer in time")
                time.sleep(backoff.next())  # a bounded poll: the donor is training meanwhile
            info = OfferTask(self.peer, self.deadline, self._name, terms.with_extra).run(ask)
        fields = info.fields
        if fields["fp"] != terms.model.fingerprint:
            raise ProtocolError("bad_fingerprint", "the donor's model has another layout")
        if fields["dtype"] != terms.model.dtype:
            raise ProtocolError("bad_dtype", f"the donor's snapshot is {fields['dtype']}, ours {terms.model.dtype}")
        # Sizes are checked before anything is allocated: ours, exactly, and at most our optimizer's.
        if fields["params_bytes"] != terms.params_bytes or fields["nbytes"] < terms.params_bytes:
            raise ProtocolError(
                "bad_size", f"an offer of {fields['params_bytes']} parameter bytes, ours is {terms.params_bytes}"
            )
        extra_bytes = fields["nbytes"] - terms.params_bytes
        budget = terms.extra_budget if terms.with_extra else 0
        if extra_bytes > budget:
            raise ProtocolError(
                "too_large",
                f"the offer holds {extra_bytes} bytes of optimizer state; we take at most {budget}"
                + ("" if terms.with_extra else " (we have no optimizer and asked for parameters only)"),
            )
        if extra_bytes and not fields.get("extra"):  # metadata with no bytes is an empty state (SGD, no momentum)
            raise ProtocolError("bad_size", f"{extra_bytes} bytes of optimizer state and no metadata")
        session, total = fields["session"], fields["nbytes"]
        data = np.empty(total, np.uint8)
        for offset in range(0, total, CHUNK_BYTES):
            end = min(total, offset + CHUNK_BYTES)

            def request(rid: int, offset: int = offset) -> list[bytes]:
                return [encode(JOIN_CHUNK, rid, **{"from": self._name}, session=session, offset=offset)]

            response = ask(request, {JOIN_DATA.name: JOIN_DATA}, deadline=time.monotonic() + self._request_s)
            frame = response.frames[0]
            if (
                response.header["offset"] != offset
                or response.header["session"] != session
                or len(frame) != end - offset
            ):
                raise ProtocolError(
                    "bad_chunk", f"a chunk for {response.header['offset']}, {len(frame)} bytes; asked {offset}"
                )
            data[offset:end] = np.frombuffer(frame.buffer, np.uint8)
        if hashlib.blake2b(data.data, digest_size=32).digest() != fields["digest"]:
            raise ProtocolError("bad_digest", "the state received does not match the offer's hash")
        params = data[: terms.params_bytes].view(terms.model.storage)
        if not kernels.within(params, MAX_VALUE, terms.model.kept):
            raise ProtocolError("not_finite", "the donor's parameters hold NaN, Inf or values out of bounds")
        meta, extra = fields.get("extra", b""), data[terms.params_bytes :]
        checked = None
        if meta and terms.check_extra is not None:
            try:
                checked = terms.check_extra(meta, extra)
            except ValueError as exc:
                raise ProtocolError("bad_extra", str(exc)) from None
        self._done(ask, session)
        return Joined(
            donor=self.peer,
            clock=info.clock,
            barriers=info.barriers,
            yours=info.yours,
            params=params,
            extra_meta=meta,
            extra=extra,
            digest=fields["digest"],
            extra_state=checked,
        )

    def _done(self, ask: Ask, session: int) -> None:
        """Tell the donor we hold its state, so its offer (a snapshot slot) goes at once, not OFFER_DONE_S later.
        Best effort: a donor that does not hear it (or does not know join_done) lets it go after OFFER_DONE_S."""

        def request(rid: int) -> list[bytes]:
            return [encode(JOIN_DONE, rid, **{"from": self._name}, session=session)]

        try:
            ask(request, {JOIN_DONE.name: JOIN_DONE}, deadline=time.monotonic() + self._request_s)
        except (TransportError, ProtocolError, Refused) as exc:
            logger.debug(
                "%s: %s did not take our join_done (%s); its offer expires by itself", self._name, self.peer, exc
            )


def _poll(
    peers: list[str], submit: Callable[[Any], Any], timeout_s: float, name: str, with_extra: bool
) -> dict[str, OfferInfo]:
    """Ask every peer where it is (no offer: cheap) at once; the answers that came within the timeout."""
    calls = {p: submit(OfferTask(p, time.monotonic() + timeout_s, name, with_extra, offer=False)) for p in peers}
    infos = {}
    for peer, call in calls.items():
        call.wait(timeout_s + 1.0)
        if call.done.is_set() and call.outcome == "ok":
            infos[peer] = call.take()
        else:
            call.abandon()
    return infos


def _take(donor: str, submit: Callable[[Any], Any], name: str, terms: JoinTerms, timeout_s: float, log) -> Any:
    """Take `donor`'s state, asking again with back-off while it answers busy. Returns the finished call."""
    deadline = time.monotonic() + max(60.0, 10 * timeout_s)
    backoff = Backoff(0.05, BUSY_RETRY_MAX_S)
    while True:
        call = submit(JoinTask(donor, deadline, name, terms, timeout_s))
        call.wait(max(0.0, deadline - time.monotonic()) + 5.0)
        if not call.done.is_set():
            call.abandon()
            return call
        pause = backoff.peek()
        if call.outcome != "refused" or call.refusal != "busy" or time.monotonic() + pause >= deadline:
            return call
        log(f"{donor} is busy ({call.reason}); asking again in {pause:.2f} s")
        time.sleep(backoff.next())  # a bounded back-off within the join's deadline


def join_cluster(
    name: str,
    order: list[str],
    submit: Callable[[Any], Any],
    ranked: Callable[[frozenset[str]], list[str]],
    timeout_s: float,
    wait_s: float,
    terms: JoinTerms,
    log: Callable[[str], None],
    trained_only: bool = False,
) -> tuple[Joined | None, bool]:
    """Find a donor and take its state (the module docstring says whom). Returns (state, cluster trained).

    `order` is every node of the config, in order (the first is "rank 0");
    `submit` runs a task on the client thread; `ranked(exclude)` orders peers
    by flow-control score; `wait_s` is how long a node waits for the first
    node at a fresh start, or, with `trained_only`, for a peer that has
    trained (a node started again whose peers restart too, and restore their
    state first). When every donor fails, the peers are asked again (at most
    :data:`JOIN_ROUNDS` times in all). Returns (None, ...) when there is
    nobody to join from.
    """
    peers = [p for p in order if p != name]
    first = order[0]
    failed: set[str] = set()
    trained = False
    for round_ in range(1, JOIN_ROUNDS + 1):
        deadline = time.monotonic() + (timeout_s if name == first and not trained_only else wait_s)
        backoff = Backoff(0.05, 1.0)  # between polls: 50 ms, doubling up to 1 s
        while True:
            infos = _poll(peers, submit, timeout_s, name, terms.with_extra)
            freshest = max((i.clock for i in infos.values()), default=0.0)
            if freshest > 0:
                # the freshest (within 10%) in a random order weighted by score, so joiners spread over
                # donors; then the other trained peers, freshest first, should those fail
                fresh = {p for p, i in infos.items() if i.clock >= 0.9 * freshest}
                rest = sorted(
                    (p for p, i in infos.items() if i.clock > 0 and p not in fresh), key=lambda p: -infos[p].clock
                )
                donors = ranked(frozenset(peers) - fresh) + rest
                trained = True
                break
            if name != first and first in infos and not trained_only:
                donors, trained = [first], False
                break
            if time.monotonic() + backoff.peek() >= deadline:
                if trained_only:
                    log(f"no peer had trained within {wait_s:.0f} s; nothing to join")
                elif name != first and round_ == 1:
                    log(f"{first} did not answer within {wait_s:.0f} s; starting from our own parameters")
                elif name != first:
                    log(f"no donor answered again within {wait_s:.0f} s; starting from our own parameters")
                return None, trained
            time.sleep(backoff.next())  # a bounded poll while the others start
        # donors that failed in an earlier round go last: they may have recovered, or be the only ones
        donors = [d for d in donors if d not in failed] + [d for d in donors if d in failed]
        reports = tuple(info.barriers for info in infos.values())
        for donor in donors:
            call = _take(donor, submit, name, terms, timeout_s, log)
            if call.done.is_set() and call.outcome == "ok":
                joined: Joined = call.take()
                return dataclasses.replace(joined, reports=reports, rejoined=trained), trained
            failed.add(donor)
            log(f"joining from {donor} failed ({call.outcome or 'timeout'}: {call.reason}); trying the next donor")
        if round_ < JOIN_ROUNDS:
            log(f"no donor of {', '.join(donors)} could give us its state; asking the peers again")
    log(f"no donor could give us its state in {JOIN_ROUNDS} rounds; starting from our own")
    return None, trained
