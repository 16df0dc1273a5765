"""A dpwa node: one model, an Rx thread that serves it, a Tx thread that asks peers.

The training thread calls :meth:`Node.update_send` before each batch and
:meth:`Node.update_wait` after it::

    with Node("cluster.yaml", "w1", NumpyParams(weights)) as node:
        for batch in batches:
            node.update_send(loss)     # publish a snapshot; maybe start a fetch
            loss = train(batch)        # the fetch runs meanwhile on the Tx thread
            node.update_wait(loss)     # blend the fetched parameters in place

``Node`` is a facade: it wires the parts together and owns only the
training thread's step. The parts own their state:

* :class:`~dpwa.gossip.snapshots.SnapshotStore`: published snapshots and their leases;
* :class:`~dpwa.wire.server.Server` (Rx thread) with the routes of
  :class:`~dpwa.gossip.serving.Serving` and, in mode symmetric,
  :class:`~dpwa.gossip.exchange.ExchangeServer`;
* :class:`~dpwa.wire.client.ClientThread` (Tx thread) running fetch and
  exchange tasks (:mod:`dpwa.gossip.requesting`, :mod:`dpwa.gossip.exchange`),
  whose results come back in calls, never by callback;
* :class:`~dpwa.gossip.flow.FlowControl`: whom to ask (training thread only);
* :class:`~dpwa.gossip.exchange.ExchangeClient`: exchanges in doubt (training thread only).

Only the training thread writes the model: fetched snapshots, and both
halves of symmetric exchanges, are applied in ``update_wait`` (or while
lingering, or at close).
"""

from __future__ import annotations

import functools
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from ..config import Config, ConfigError, load_config, parse_config, pointless_settings
from ..gossip.rendezvous import rendezvous
from ..logs import RateLimitedLog, logger
from ..mixing import interpolation as interp
from ..mixing import kernels, pairing, rules
from ..mixing.params import FlatParams
from ..stats import Counters, Rate
from ..wire.bulk import BulkServer
from ..wire.calls import Call
from ..wire.client import ClientThread, DirectClient
from ..wire.curve import CurveKeys, KeyFileError, KeyPair, load_secret
from ..wire.endpoints import is_local_host
from ..wire.schema import LARGEST_HEADER_BYTES
from ..wire.server import Server
from ..wire.shm import PeerSlots, SharedMemoryError, SharedSlots
from .barrier import BarrierCounts, BarrierServer, BarrierTask, BarrierTimeout, plausible
from .exchange import (
    SETTLE_QUIET_S,
    AckQueries,
    ClientHalf,
    ExchangeClient,
    ExchangeServer,
    ExchangeTask,
    InDoubt,
)
from .flow import FlowControl
from .join import CHUNK_BYTES, ExtraState, Joined, JoinServer, JoinTerms, join_cluster
from .protocol import MAX_CLOCK, MAX_LOSS
from .requesting import FetchTask, ReplyReader
from .serving import Serving
from .settings import blend_of, interpolation_of
from .snapshots import Lease, SlotAllocator, SnapshotStore
from .status import StatusServer, StatusTask
from .validation import PeerValues

__all__ = ["Node", "Update", "WAIT_SLACK_S"]

WAIT_SLACK_S = 0.2  # update_wait returns at most this long after a request's deadline
MAX_SNAPSHOT_SLOTS = 6  # snapshot slots in use at most; past that (and none stale), publishing is skipped
EXCHANGE_CAPACITY = 4  # symmetric: requester snapshots a server holds at most
# Pull-mode fetches of models up to this size from peers on other machines run on the training thread
# (DirectClient): two thread wake-ups cost more than checking a small reply; larger ones are received
# and checked on the Tx thread, in parallel with training.
DIRECT_MAX_BYTES = 1 << 20
# Over TCP, snapshots of at least this size stream over raw TCP, sealed per transfer in keyed clusters
# (dpwa.wire.bulk, config key `bulk`).
BULK_MIN_BYTES = 4 << 20
UNSENT_PER_CLIENT = 3  # replies with a payload one client may leave unsent (ZeroMQ reports "sent" a little late)
BUSY_RETRY_MAX_S = 0.02  # symmetric: how long an exchange may keep asking busy peers again
JOIN_WAIT_MIN_S = 10.0  # at a fresh start, how long a node waits at least for the first node's parameters
BARRIER_POLL_MAX_S = 1.0  # a peer not yet at a barrier is asked again at most this long after the last time


@dataclass(frozen=True)
class Update:
    """What one update_wait did, for logging."""

    averaged: bool  # True if a peer's parameters were blended in
    outcome: str  # ok | no_fetch | timeout | refused | rejected | failed | expired | cancelled | in_doubt
    peer: str | None = None  # the peer asked, if any
    factor: float | None = None  # f in params = f * peer + (1 - f) * params, when averaged
    reason: str = ""  # why not averaged, in words
    latency_s: float | None = None  # request time, when a request finished
    clock: float = 0.0  # this node's clock after the update


@dataclass(eq=False)
class _Step:
    """The training thread's current step, from update_send to update_wait."""

    batch: float
    send_loss: float | None
    call: Call | None = None
    deadline: float = 0.0
    own: Lease | None = None  # pull/delta: our snapshot of this step, which the delta is taken from


def _as_config(config: Config | str | os.PathLike[str] | Mapping[str, Any] | list) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    if isinstance(config, (Mapping, list)):
        return parse_config(config, source="<dict>")
    raise ConfigError(f"config must be a Config, a file path or parsed YAML data, got {type(config).__name__}")


def _loss_value(loss: Any) -> float | None:
    """A reported loss as a float within ±MAX_LOSS (what the wire carries), or None if unknown (None, NaN, Inf)."""
    if loss is None:
        return None
    try:
        value = float(loss.item() if hasattr(loss, "item") else loss)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"loss must be a number, a 0-d tensor or None, got {type(loss).__name__}") from exc
    return min(max(value, -MAX_LOSS), MAX_LOSS) if math.isfinite(value) else None


def _clamp_clock(clock: float) -> float:
    return min(max(clock, 0.0), MAX_CLOCK)


class Node:
    """One participant of pairwise gossip averaging.

    Args:
        config: a :class:`Config`, a path to a YAML file, or parsed YAML data.
        name: which node of the config this process is (None with ``nodes: torchrun``: ``rank<RANK>``).
        params: the model as a :class:`~dpwa.mixing.params.FlatParams`.
        rng: randomness for fetch decisions and peer choice (seed it for tests).
        extra: state a joining peer takes too, besides the parameters (an optimizer's).
    """

    def __init__(
        self,
        config: Config | str | os.PathLike[str] | Mapping[str, Any] | list,
        name: str | None,
        params: FlatParams,
        *,
        rng: random.Random | None = None,
        extra: ExtraState | None = None,
    ) -> None:
        self.config = _as_config(config)
        keys = None
        met = None
        if not self.config.resolved:  # nodes: torchrun: meet the other workers through torchrun's store
            met = rendezvous(self.config)
            if name is not None and name != met.name:
                raise ConfigError(f"{self.config.source}: under torchrun this worker is {met.name!r}, not {name!r}")
            self.config, name, keys = met.config, met.name, met.keys
        if name is None:
            raise ConfigError(
                f"{self.config.source}: which node is this? give its name (None only with nodes: torchrun)"
            )
        self.spec = self.config.node(name)  # raises before any socket exists
        self.name = name
        self.params = params
        self.peers = {spec.name: spec for spec in self.config.peers_of(name)}
        self.wire = self.config.wire_dtype
        self._storage = kernels.storage_dtype(self.wire)
        self.nbytes = params.size * self._storage.itemsize  # bytes of one snapshot on the wire
        self._rng = rng or random.Random()
        self._interpolation = interpolation_of(self.config)
        self._blend = blend_of(self.config)
        self._symmetric = self.config.mode == "symmetric"
        self.counters = Counters()
        self._log = RateLimitedLog()
        self._flow = FlowControl(
            name,
            list(self.peers),
            self.config.fetch_probability,
            self.config.timeout_s,
            self._rng,
            schedule=self._hypercube() if self.config.pairing == "hypercube" else None,
        )
        self._clock = 0.0
        self._step: _Step | None = None
        self._step_s = 0.0  # a running estimate of the time between two update_send calls
        self._last_send = 0.0
        self._outstanding: list[Call] = []  # symmetric: exchange calls whose result is not yet taken
        self._stray: list[Call] = []  # calls whose result nobody needs (a barrier's last word to a peer)
        self._barriers = BarrierCounts(list(self.peers))
        self._loss: float | None = None  # the last loss reported
        self._rate = Rate()  # blends per second, for status
        self._started = time.monotonic()
        self.state = "starting"  # starting | joining | training | at_barrier | lingering | closing | closed
        self._close_lock = threading.Lock()
        # Resources, made by _open; close() releases whichever exist, on every path.
        self._store: SnapshotStore | None = None
        self._shared: SharedSlots | None = None
        self._ctx: zmq.Context | None = None
        self._client: ClientThread | None = None
        self._direct: DirectClient | None = None  # pull-mode fetches of a small model (training thread)
        self._bulk: BulkServer | None = None  # streams large snapshots to peers (sealed in keyed clusters)
        self._server: Server | None = None
        self._reader: ReplyReader | None = None
        self._exchange_server: ExchangeServer | None = None
        self._exchange_client: ExchangeClient | None = None
        self._extra = extra
        self._joins: JoinServer | None = None
        self.joined: Joined | None = None  # the state this node took from a peer at start, if it did
        curve = self._load_curve(keys)  # key problems are reported before any socket exists

        logger.info("%s: starting on %s; %s", name, self.config.bind_endpoint(self.spec), self.config.describe())
        for note in pointless_settings(self.config):
            logger.warning("%s: %s", name, note)
        try:
            self._open(curve)
            trained = False
            if self.config.join == "auto" and self.peers:
                self.state = "joining"
                trained = self._join()
            self._publish(None)  # our state, for a peer that joins now, and for fetches
            # Like DDP's constructor, return once every node holds the same initial state: nobody trains
            # alone because it started first (a late or restarted node joins a cluster that trains).
            self.state = "at_barrier"
            if met is not None:
                met.start_barrier()
            elif self.config.join == "auto" and self.peers and not trained:
                self._start_together(max(JOIN_WAIT_MIN_S, 4 * self.config.timeout_s))
        except BaseException:
            self.close()
            raise
        self.state = "training"

    def _load_curve(self, keys: KeyPair | None) -> CurveKeys | None:
        """Our CURVE keys: made at the rendezvous (`keys`), or read from our secret key file."""
        allowed = {z85.decode(spec.public_key.encode()): spec.name for spec in self.config.nodes if spec.public_key}
        if keys is not None:
            return CurveKeys(public=keys.public, secret=keys.secret, allowed=allowed)
        if not self.config.secure:
            if self.config.insecure:
                logger.warning(
                    "%s: insecure: true: serving %s without CURVE; anyone who reaches it can read "
                    "this node's parameters and offer it theirs",
                    self.name,
                    self.config.bind_endpoint(self.spec),
                )
            return None
        if self.spec.secret_key_file is None:
            raise ConfigError(
                f"{self.config.source}: node {self.name!r} has a public_key but no secret_key_file: "
                "it cannot prove who it is"
            )
        try:
            pair = load_secret(self.spec.secret_key_file, self.spec.public_key or "")
        except KeyFileError as exc:
            raise ConfigError(f"{self.config.source}: node {self.name!r}: {exc}") from None
        return CurveKeys(public=pair.public, secret=pair.secret, allowed=allowed)

    def _open(self, curve: CurveKeys | None) -> None:
        address = self.config.bind_address(self.spec) if self.config.transport == "tcp" else ""
        endpoint = self.config.bind_endpoint(self.spec, address)  # every listener binds the same address
        local = self._same_host_peers()
        unsent = UNSENT_PER_CLIENT * (len(self.peers) + 1)  # each sender its own budget
        self._store = store = SnapshotStore(
            self.params.size,
            self._storage,
            max_slots=MAX_SNAPSHOT_SLOTS,
            memory=SlotAllocator(self.params.size, self._storage, self.params.allocate, self._shared, self.name),
            hold_limit_s=self.config.timeout_s + 1.0,
            max_retired=unsent,
        )
        self._ctx = zmq.Context()
        options = None
        if curve is not None:
            options = {p: curve.client_options(s.public_key.encode()) for p, s in self.peers.items() if s.public_key}
        endpoints = {peer: self.config.endpoint(spec) for peer, spec in self.peers.items()}
        max_reply = max(self.nbytes, LARGEST_HEADER_BYTES, CHUNK_BYTES)
        self._client = ClientThread(
            self._ctx, endpoints, name=self.name, max_reply_bytes=max_reply, socket_options=options
        ).start()
        if not self._symmetric and self.nbytes <= DIRECT_MAX_BYTES:
            self._direct = DirectClient(
                self._ctx, endpoints, name=self.name, max_reply_bytes=max_reply, socket_options=options
            )
        values = PeerValues(self.wire, self.config.max_peer_distance, store.lease)
        readers = {peer: PeerSlots(peer, self.peers[peer].port) for peer in local}
        bulk_hosts: dict[str, str] = {}
        config = self.config
        if config.bulk == "auto" and config.transport == "tcp" and self.nbytes >= BULK_MIN_BYTES:
            self._bulk = BulkServer(
                address,
                sealed=config.secure,  # with keys, every stream is sealed with a key of its own
                name=self.name,
                counters=self.counters,
                max_per_sender=UNSENT_PER_CLIENT,
                max_pending=unsent,
                max_connections=4 * (len(self.peers) + 1),
            )
            if not self._symmetric:
                bulk_hosts = {peer: spec.host for peer, spec in self.peers.items() if peer not in local}
        self._reader = ReplyReader(
            self.params.fingerprint,
            self.wire,
            self.nbytes,
            self._storage,
            values,
            readers,
            self.counters,
            lambda message: logger.info("%s: %s", self.name, message),
            bulk_hosts=bulk_hosts,
            sealed=config.secure,
            name=self.name,
        )
        serving = Serving(
            self.name,
            self._store,
            self.params.fingerprint,
            self.wire,
            self.nbytes,
            self._shared.id if self._shared else None,
            self.counters,
            bulk=self._bulk,
            bulk_ttl_s=self.config.timeout_s + 1.0,
        )
        routes = serving.routes()
        routes.update(BarrierServer(self._barriers, list(self.peers)).routes())
        self._joins = JoinServer(
            self.name,
            store,
            self.params.fingerprint,
            self.wire,
            self._barriers,
            lambda: self.state,
            self._extra,
            list(self.peers),
        )
        routes.update(self._joins.routes())
        routes.update(StatusServer(self._status_report).routes())
        if self._symmetric:
            self._exchange_server = ExchangeServer(
                serving,
                values,
                self._interpolation,
                self.config.divergence_threshold,
                self.config.timeout_s,
                EXCHANGE_CAPACITY,
                self.counters,
            )
            routes.update(self._exchange_server.routes())
            self._exchange_client = ExchangeClient(
                self.name, list(self.peers), self.config.timeout_s, self._client.submit, self.counters, self._flow.heard
            )
            routes.update(self._exchange_client.known.routes())
        self._server = Server(
            self._ctx,
            endpoint,
            routes,
            name=self.name,
            counters=self.counters,
            curve=curve,
            senders=[spec.name for spec in self.config.nodes],
            max_unsent_per_client=UNSENT_PER_CLIENT,
            max_unsent=unsent,
        ).start()

    def join(self, wait_s: float = 60.0) -> bool:
        """Take a trained peer's state now, waiting up to `wait_s` for a peer that has trained.

        For a node started again together with its peers (torchrun restarts
        every worker): the others restore their own state first, and this one,
        which has none, then joins from them. Returns True if it took a state.
        """
        self._check_open()
        previous, self.state = self.state, "joining"
        try:
            self._join(trained_only=True, wait_s=wait_s)
        finally:
            self.state = previous
        if self.joined is not None:
            self._publish(self._loss)
        return self.joined is not None

    def _hypercube(self) -> Callable[[int], str | None]:
        """pairing: hypercube: round -> our partner, or None when the partner starts the exchange."""
        order = [spec.name for spec in self.config.nodes]
        index, n, mode = order.index(self.name), len(order), self.config.mode

        def partner(round_: int) -> str | None:
            other = pairing.hypercube_partner(index, n, round_)
            return order[other] if pairing.initiates(index, other, mode) else None

        return partner

    def _join(self, trained_only: bool = False, wait_s: float | None = None) -> bool:
        """Take the cluster's state from a peer before training (see dpwa.gossip.join).

        Returns whether the cluster has trained already (a peer's clock is above 0).
        """
        client = self._client
        assert client is not None
        extra = self._extra
        terms = JoinTerms(
            self.params.fingerprint,
            self.wire,
            self.nbytes,
            extra_budget=extra.budget() if extra is not None else 0,
            check_extra=extra.check if extra is not None else None,
        )
        joined, trained = join_cluster(
            self.name,
            [spec.name for spec in self.config.nodes],
            client.submit,
            self._flow.selector.ranked,
            self.config.timeout_s,
            wait_s if wait_s is not None else max(JOIN_WAIT_MIN_S, 4 * self.config.timeout_s),
            terms,
            lambda message: logger.warning("%s: %s", self.name, message),
            trained_only=trained_only,
        )
        if joined is None:
            return trained
        self.params.lerp_from(joined.params, 1.0, self.wire)  # f = 1 takes the donor's snapshot exactly
        if extra is not None and joined.extra_state is not None:
            extra.load(joined.extra_state)  # checked on arrival, field by field (ExtraState.check)
        if trained:  # a late or restarted node: it continues where the cluster is
            self._clock = _clamp_clock(joined.clock)
            # where the cluster is, or where we were if the donor knew us further on: never beyond what the peers say
            for counts, what in ((joined.barriers, "its barrier counts"), (joined.yours, "our barrier counts")):
                adopted, cut = plausible(counts, joined.reports)
                if cut:
                    logger.warning(
                        "%s: %s gave %s beyond what the other peers report (%s); took %s",
                        self.name,
                        joined.donor,
                        what,
                        ", ".join(f"{n}={counts[n]}" for n in cut),
                        ", ".join(f"{n}={adopted[n]}" for n in cut),
                    )
                self._barriers.restore(adopted)
        self.joined = joined
        self.counters.add("joined")
        logger.info(
            "%s: took %s's state (clock %.0f, barriers %s, %s, digest %s)",
            self.name,
            joined.donor,
            joined.clock,
            self._barriers.own() if trained else "not taken at a fresh start",
            "with its optimizer state" if joined.extra_state is not None else "parameters only",
            joined.digest.hex(),
        )
        return trained

    def _start_together(self, wait_s: float) -> None:
        """A fresh start of a node list: wait until every peer has joined (taken the first node's state),
        or has trained already, or `wait_s` passed (then say who is missing and go on: it joins later)."""
        client = self._client
        assert client is not None
        deadline = time.monotonic() + wait_s
        waiting = set(self.peers)
        pause = 0.01
        while waiting:
            end = time.monotonic() + self.config.timeout_s
            calls = {peer: client.submit(StatusTask(peer, end, self.name)) for peer in waiting}
            for peer, call in calls.items():
                call.wait(self.config.timeout_s + WAIT_SLACK_S)
                if not call.done.is_set() or call.outcome != "ok":
                    call.abandon()
                    continue
                report = call.take()
                if report["state"] not in ("starting", "joining") or report["clock"] > 0:
                    waiting.discard(peer)
            if not waiting:
                return
            if time.monotonic() + pause >= deadline:
                logger.warning(
                    "%s: %s did not start within %.0f s; training without waiting for them (they join later)",
                    self.name,
                    ", ".join(sorted(waiting)),
                    wait_s,
                )
                return
            time.sleep(pause)  # a bounded poll while the others join
            pause = min(0.2, 2 * pause)

    def _same_host_peers(self) -> list[str]:
        """Peers on this machine whose snapshots we read from shared memory (and who read ours)."""
        if self.config.same_host == "off":
            return []
        local = [peer for peer, spec in self.peers.items() if is_local_host(spec.host)]
        if not local:
            return []
        try:
            self._shared = SharedSlots(self.name, self.spec.port, self.nbytes, self._storage)
        except (SharedMemoryError, OSError) as exc:
            logger.warning("%s: same-host peers will use TCP: shared memory is unavailable: %s", self.name, exc)
            return []
        logger.info("%s: same-host path (shared memory) for %s", self.name, ", ".join(local))
        return local

    @property
    def _snapshots(self) -> SnapshotStore:
        assert self._store is not None, "the node is open"
        return self._store

    # ----------------------------------------------------------------- training thread

    def update_send(self, loss: Any = None, batch_size: float = 1) -> bool:
        """Publish the current parameters, clock and loss; maybe start a fetch (or an exchange).

        Call it before each batch. `batch_size` is added to the clock once the
        batch is done (the default 1 makes the clock count batches). Returns
        True if a request was started; :meth:`update_wait` collects it.
        """
        self._check_open()
        if not (isinstance(batch_size, (int, float)) and 0 <= batch_size <= MAX_CLOCK) or isinstance(batch_size, bool):
            raise ValueError(f"batch_size must be a number in [0, {MAX_CLOCK:g}], got {batch_size!r}")
        if self._step is not None:  # update_wait was skipped: count the batch, drop the fetch
            self._abandon_step()
        self._tend()
        now = time.monotonic()
        if self._last_send:
            self._step_s = 0.8 * self._step_s + 0.2 * (now - self._last_send) if self._step_s else now - self._last_send
        self._last_send = now
        step = self._step = _Step(float(batch_size), _loss_value(loss))
        if self._symmetric:  # the request carries our snapshot: publish it first
            self._publish(step.send_loss)
            return self._start_exchange(step)
        # Start the fetch first: it does not need our snapshot, so the copy overlaps with the request.
        candidates = self._flow.candidates()
        peer = candidates[0] if candidates else None
        if peer is not None:
            assert self._reader is not None and self._client is not None
            step.deadline = time.monotonic() + self.config.timeout_s
            task = FetchTask(peer, step.deadline, self.name, self._reader)
            # A same-host reply names a slot the peer may rewrite before update_wait: the Tx thread locks it
            # at once. Other small replies wait in ZeroMQ's queue, and the training thread takes them.
            direct = self._direct if self._direct is not None and not self._reader.wants_shm(peer) else None
            step.call = direct.start(task) if direct is not None else self._client.submit(task)
            self.counters.add("fetches_started")
        self._publish(step.send_loss)
        if step.call is not None and isinstance(self._blend, rules.DeltaBlend):
            step.own = self._snapshots.lease()  # the snapshot the delta is taken from
        return step.call is not None

    def _publish(self, loss: float | None) -> None:
        fill = functools.partial(self.params.copy_to, wire=self.wire)
        if not self._snapshots.publish(fill, self._clock, loss):
            self._log(
                30,
                "publish_skipped",
                "%s: every snapshot slot is held by readers; peers get the previous snapshot",
                self.name,
            )
        if self._joins is not None:
            self._joins.capture_if_wanted()  # a peer is joining: our optimizer state, paired with this snapshot

    def _start_exchange(self, step: _Step) -> bool:
        exchanges, reader, client = self._exchange_client, self._reader, self._client
        assert exchanges is not None and reader is not None and client is not None
        if not exchanges.can_start():
            return False
        peers = self._flow.candidates(exclude=exchanges.blocked_peers())
        if not peers:
            return False
        own = self._snapshots.lease()
        if own is None:  # nothing published (every slot held at our first publish): nothing to offer
            return False
        snap = own.snapshot
        common = {
            "from": self.name,
            "fp": self.params.fingerprint,
            "dtype": self.wire,
            "nbytes": self.nbytes,
            "clock": snap.clock,
            "loss": snap.loss,
        }

        def fields(peer: str) -> dict[str, Any]:
            return {**common, "shm": True} if reader.wants_shm(peer) else common

        factor = functools.partial(rules.symmetric_factor, self._interpolation, self.config.divergence_threshold)
        step.deadline = time.monotonic() + self.config.timeout_s
        # A busy peer is asked again a little later, for at most half a step: never long enough to slow training.
        busy_budget = min(BUSY_RETRY_MAX_S, 0.5 * self._step_s)
        task = ExchangeTask(peers, step.deadline, own, fields, reader, factor, self.config.timeout_s / 10, busy_budget)
        step.call = client.submit(task)
        self._outstanding.append(step.call)
        self.counters.add("fetches_started")
        return True

    def update_wait(self, loss: Any = None) -> Update:
        """Finish the step: wait for the request started by update_send, if any, and blend in place.

        Returns at once when no request was started, and never waits longer
        than ``timeout_ms`` plus a small slack. When the request failed the
        parameters are left as they are. `loss` is this batch's loss (the
        loss given to update_send is used when it is None).
        """
        self._check_open()
        step, self._step = self._step, None
        if step is None:
            self._tend()
            return Update(False, "no_fetch", reason="no update_send before this update_wait", clock=self._clock)
        self._clock = _clamp_clock(self._clock + step.batch)
        own_loss = _loss_value(loss)
        if own_loss is None:
            own_loss = step.send_loss
        self._loss = own_loss if own_loss is not None else self._loss
        self._rate.sample(time.monotonic(), self.counters.get("averaged") + self.counters.get("mirrored"))
        try:
            if step.call is not None:
                step.call.wait(max(0.0, step.deadline + WAIT_SLACK_S - time.monotonic()))
            if self._symmetric:
                return self._finish_exchange(step)
            return self._finish_fetch(step, own_loss)
        finally:
            if step.own is not None:
                step.own.release()

    def _finish_fetch(self, step: _Step, own_loss: float | None) -> Update:
        call = step.call
        if call is None:
            return Update(False, "no_fetch", reason="no fetch was started this step", clock=self._clock)
        if not call.done.is_set():
            call.abandon()
            self._flow.record(call.peer, "timeout")
            self.counters.add("fetches_timed_out")
            return Update(False, "timeout", call.peer, reason="the Tx thread did not finish in time", clock=self._clock)
        self._record(call)
        if call.outcome != "ok":
            return Update(
                False, call.outcome, call.peer, reason=call.reason, latency_s=call.latency_s, clock=self._clock
            )
        own = step.own.snapshot if step.own is not None else None
        with call.take() as received:
            peer_clock, peer_loss = received.header["clock"], received.header["loss"]
            f = self._interpolation.factor(self._clock, peer_clock, own_loss, peer_loss)
            f = interp.damp_by_divergence(f, own_loss, self.config.divergence_threshold)
            self._blend.apply(self.params, own.array if own else None, received.array, f, self.wire)
        self._clock = _clamp_clock(self._blend.clock(self._clock, own.clock if own else 0.0, peer_clock, f))
        self.counters.add("averaged")
        self.counters.add(f"peer.{call.peer}.averaged")
        return Update(True, "ok", call.peer, factor=f, latency_s=call.latency_s, clock=self._clock)

    def _finish_exchange(self, step: _Step) -> Update:
        call = step.call
        result = None
        if call is not None and call.done.is_set():
            self._outstanding.remove(call)
            result = self._harvest(call)
        self._tend()
        if call is None:
            return Update(False, "no_fetch", reason="no exchange was started this step", clock=self._clock)
        if result is None:
            return Update(
                False, "timeout", call.peer, reason="no outcome yet; it is settled in a later step", clock=self._clock
            )
        return result

    def _harvest(self, call: Call) -> Update:
        """Take an exchange call's result: apply a committed half, keep one in doubt."""
        if call.outcome != "ok":
            self._record(call)
            return Update(
                False, call.outcome, call.peer, reason=call.reason, latency_s=call.latency_s, clock=self._clock
            )
        value = call.take()
        if isinstance(value, InDoubt):
            assert self._exchange_client is not None
            self._flow.record(call.peer, "rejected" if value.answered else "timeout")
            self._exchange_client.add(value)
            return Update(
                False,
                "in_doubt",
                call.peer,
                reason="the peer's decision did not arrive; it is asked again in the background",
                latency_s=call.latency_s,
                clock=self._clock,
            )
        self._record(call)
        f = self._apply_client_half(value)
        return Update(True, "ok", call.peer, factor=f, latency_s=call.latency_s, clock=self._clock)

    def _apply_client_half(self, half: ClientHalf) -> float:
        with half:
            own, theirs = half.own.snapshot, half.theirs
            self._blend.apply(self.params, own.array, theirs.array, half.f, self.wire)
            self._clock = _clamp_clock(self._blend.clock(self._clock, own.clock, theirs.header["clock"], half.f))
        self.counters.add("averaged")
        self.counters.add(f"peer.{half.peer}.averaged")
        assert self._exchange_client is not None
        self._exchange_client.hold(half)  # a closing peer that asks learns we hold its commit
        return half.f

    def _keep_exchanging(self) -> None:
        """While making no steps: apply settled exchanges, and publish a fresh snapshot once the current one
        is spent (mode symmetric), so that peers still training are not refused busy."""
        applied = self._tend()
        if self._exchange_server is not None and (applied or self._exchange_server.spent()):
            self._publish(self._loss)

    def _tend(self) -> int:
        """Apply what symmetric exchanges have settled since the last call: both sides' halves. Returns how many."""
        self._stray = [call for call in self._stray if not call.done.is_set()]
        if self._joins is not None and self._joins.wanted.is_set() and self.state in ("at_barrier", "lingering"):
            self._publish(self._loss)  # a peer is joining while we make no steps: offer our state as of now
        if not self._symmetric:
            return 0
        assert self._exchange_server is not None and self._exchange_client is not None
        applied = 0
        for half in self._exchange_server.take_committed():
            with half:
                served = half.served.snapshot
                rules.mirror(self.params, served.array, half.theirs.array, half.f, self.wire)
                their_clock = half.theirs.header["clock"]
                self._clock = _clamp_clock(rules.mirror_clock(self._clock, served.clock, their_clock, half.f))
            self.counters.add("mirrored")
            self.counters.add(f"peer.{half.peer}.averaged")
            applied += 1
        for call in [c for c in self._outstanding if c.done.is_set()]:
            self._outstanding.remove(call)
            applied += self._harvest(call).averaged
        for client_half in self._exchange_client.poll():
            self._apply_client_half(client_half)
            applied += 1
        return applied

    def _record(self, call: Call) -> None:
        """Count a finished request and let flow control learn from it."""
        self._flow.record(call.peer, call.outcome, call.refusal)
        busy = getattr(call.task, "busy", 0)
        if busy:
            self.counters.add("busy_answers", busy)
        if call.outcome == "ok":
            self.counters.add("fetches_ok")
            self.counters.set("last_fetch_latency_s", call.latency_s)
            self.counters.set(f"peer.{call.peer}.latency_s", call.latency_s)
            retries = getattr(call.task, "retries", 0)
            if retries:
                self.counters.add("same_host_retries", retries)
            return
        if call.outcome == "refused" and call.refusal in ("busy", "aborted", "closing"):
            self.counters.add(f"fetches_{call.refusal}")
            return
        key = {
            "timeout": "fetches_timed_out",
            "rejected": "fetches_rejected",
            "refused": "fetches_refused",
            "cancelled": "fetches_cancelled",
            "expired": "fetches_expired",
        }.get(call.outcome, "fetches_failed")
        self.counters.add(key)
        if call.outcome in ("cancelled", "expired"):
            return
        self.counters.add(f"peer.{call.peer}.failures")
        self._log(
            30, (call.peer, call.outcome), "%s: fetch from %s %s: %s", self.name, call.peer, call.outcome, call.reason
        )

    def _abandon_step(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        self._clock = _clamp_clock(self._clock + step.batch)
        if step.call is not None and not self._symmetric:
            step.call.abandon()  # an exchange call stays outstanding: its outcome still matters
            self.counters.add("fetches_abandoned")
        if step.own is not None:
            step.own.release()

    def linger(self, idle_s: float, limit_s: float, stop: Callable[[], bool] = lambda: False) -> float:
        """Keep serving peers, without training, until none was served for `idle_s` (or `limit_s` passed).

        A node that finishes first and exits would cost each remaining peer a
        request timeout per step; staying up while it is still asked avoids
        it. Only requests actually served count (not refusals, nor status requests). In mode
        symmetric the exchanges peers confirm are applied, and a new snapshot
        is published after each, so a lingering node keeps taking part.
        Returns the time spent.
        """
        self._check_open()
        self._abandon_step()
        self.state = "lingering"
        start = last_change = time.monotonic()

        def served() -> int:  # what peers still training ask for (not someone watching our status)
            return self.counters.get("requests_served") - self.counters.get("served.status")

        last = served()
        committed = self._exchange_server.committed if self._exchange_server is not None else threading.Event()
        try:
            while not stop() and time.monotonic() - start < limit_s:
                committed.clear()
                self._keep_exchanging()
                now_served = served()
                if now_served != last:
                    last, last_change = now_served, time.monotonic()
                elif time.monotonic() - last_change >= idle_s:
                    break
                committed.wait(0.02)  # woken by a commit; else a bounded poll while the Rx thread serves
        finally:
            self.state = "training"
        return time.monotonic() - start

    def barrier(
        self,
        name: str = "epoch",
        timeout_s: float | None = None,
        missing: str = "raise",
        stop: Callable[[], bool] = lambda: False,
    ) -> list[str]:
        """Wait until every node has made as many calls of barrier `name` as this one (this call included).

        The k-th call returns once every node of the cluster has made its k-th
        call with this name, or a later one. There is no master: each node
        tells its peers its counters and asks for theirs (see
        :mod:`dpwa.gossip.barrier`). Meanwhile the node keeps serving its
        peers, and settled exchanges are applied. A node that has closed or
        died never arrives: after `timeout_s` (None: wait for ever) this raises
        :class:`~dpwa.gossip.barrier.BarrierTimeout` naming the missing nodes,
        or, with ``missing="proceed"``, logs them and returns their names.
        Returns the nodes skipped ([] when everyone arrived). `stop` is
        asked between polls: once it returns True (a SIGTERM, say) the wait
        ends at once and returns the nodes not yet arrived, whatever
        `missing` says; this call still counts as made.
        """
        self._check_open()
        if missing not in ("raise", "proceed"):
            raise ValueError(f"missing must be 'raise' or 'proceed', got {missing!r}")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s >= 0):
            raise ValueError(f"timeout_s must be a number of seconds >= 0 or None, got {timeout_s!r}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", name):
            raise ValueError(f"a barrier name is 1 to 32 letters, digits, '_', '.' or '-', got {name!r}")
        k = self._barriers.arrive(name)
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        previous, self.state = self.state, "at_barrier"
        try:
            return self._wait_at_barrier(name, k, deadline, missing, stop)
        finally:
            self.state = previous

    def _wait_at_barrier(self, name: str, k: int, deadline: float, missing: str, stop: Callable[[], bool]) -> list[str]:
        client = self._client
        assert client is not None
        calls: dict[str, Call] = {}
        told: set[str] = set()  # peers that have heard of this arrival
        next_try = {peer: 0.0 for peer in self.peers}
        pause = dict.fromkeys(self.peers, 0.01)
        while True:
            for peer, call in list(calls.items()):
                if not call.done.is_set():
                    continue
                del calls[peer]
                if call.outcome == "ok":
                    theirs, _ = call.take()
                    self._barriers.heard(peer, theirs)
                    told.add(peer)
                pause[peer] = min(BARRIER_POLL_MAX_S, 2 * pause[peer])
                next_try[peer] = time.monotonic() + pause[peer]
            behind = self._barriers.behind(name, k)
            now = time.monotonic()
            if not behind:
                self._tell(name, [p for p in self.peers if p not in told], calls)
                return []
            stopped = stop()
            if now >= deadline or stopped:
                heard = self._barriers.all_heard()
                for call in calls.values():
                    call.abandon()
                if stopped:
                    logger.info(
                        "%s: stopped at barrier %r (call %d) before %s arrived", self.name, name, k, ", ".join(behind)
                    )
                    return behind
                if missing == "raise":
                    raise BarrierTimeout(name, k, behind, heard)
                logger.warning("%s: barrier %r (call %d): proceeding without %s", self.name, name, k, ", ".join(behind))
                return behind
            for peer in self.peers:
                if (peer in behind or peer not in told) and peer not in calls and now >= next_try[peer]:
                    end = min(deadline, now + self.config.timeout_s)
                    calls[peer] = client.submit(BarrierTask(peer, end, self.name, self._barriers.own()))
            self._keep_exchanging()
            wake = min([next_try[p] for p in self.peers if p not in calls] + [now + 0.02])
            time.sleep(max(0.001, min(0.02, wake - now)))  # a bounded poll: the Tx thread asks meanwhile

    def _tell(self, name: str, peers: list[str], calls: dict[str, Call]) -> None:
        """Best effort: let peers that have not heard of our arrival hear of it (nobody waits for the answers)."""
        for call in calls.values():
            self._stray.append(call)
        client = self._client
        assert client is not None
        for peer in peers:
            if peer not in calls:
                task = BarrierTask(peer, time.monotonic() + self.config.timeout_s, self.name, self._barriers.own())
                self._stray.append(client.submit(task))

    def barrier_counters(self) -> dict[str, int]:
        """How many calls of each barrier this node has made (for a checkpoint)."""
        return self._barriers.own()

    def restore(self, clock: float | None = None, barriers: Mapping[str, int] | None = None) -> None:
        """Resume from a checkpoint: set the clock, and barrier counters (a count never goes down)."""
        self._check_open()
        if clock is not None:
            if not (isinstance(clock, (int, float)) and math.isfinite(clock) and 0 <= clock <= MAX_CLOCK):
                raise ValueError(f"clock must be a number in [0, {MAX_CLOCK:g}], got {clock!r}")
            self._clock = float(clock)
        if barriers is not None:
            self._barriers.restore(barriers)

    def _status_report(self) -> dict[str, Any]:
        """The numbers a ``status`` request gets (read from the Rx thread: each read is atomic)."""
        stats = self.counters.snapshot()
        scores = self._flow.selector.scores()
        now = time.monotonic()
        blends = stats.get("averaged", 0) + stats.get("mirrored", 0)
        pending = 0
        if self._exchange_server is not None:
            pending = self._exchange_server.held() + (len(self._exchange_client) if self._exchange_client else 0)
        return {
            "name": self.name,
            "state": self.state,
            "epoch": self._barriers.own().get("epoch", 0),
            "clock": self._clock,
            "loss": self._loss,
            "exchanges_per_s": self._rate.per_second(now, blends),
            "averaged": blends,
            "failures": sum(stats.get(f"peer.{p}.failures", 0) for p in self.peers),
            "bytes_in": stats.get("bytes_in", 0) + stats.get("shm_bytes_in", 0),  # sockets and shared memory
            "bytes_out": stats.get("bytes_out", 0) + stats.get("shm_bytes_out", 0),
            "served": stats.get("requests_served", 0),
            "pending": pending,
            "uptime_s": now - self._started,
            "peers": {
                peer: {
                    "score": scores[peer],
                    "failures": stats.get(f"peer.{peer}.failures", 0),
                    "latency_s": stats.get(f"peer.{peer}.latency_s"),
                    "averaged": stats.get(f"peer.{peer}.averaged", 0),
                }
                for peer in self.peers
            },
            "barriers": self._barriers.own(),
        }

    @property
    def clock(self) -> float:
        """Samples (or batches) trained, blended with peers' clocks at each average."""
        return self._clock

    # ----------------------------------------------------------------- lifecycle

    def stats(self) -> dict[str, Any]:
        """Counters (requests ok, timed out, rejected; bytes in and out; ...) and per-peer scores."""
        out = self.counters.snapshot()
        for key in (
            "fetches_started",
            "fetches_ok",
            "fetches_timed_out",
            "fetches_rejected",
            "fetches_refused",
            "fetches_failed",
            "averaged",
            "bytes_in",
            "bytes_out",
            "requests_served",
            "requests_rejected",
            "requests_refused",
            "same_host_fetches",
            "shm_bytes_in",
            "shm_bytes_out",
        ):
            out.setdefault(key, 0)
        out.setdefault("last_fetch_latency_s", None)
        scores = self._flow.selector.scores()
        out["peers"] = {
            peer: {
                "score": scores[peer],
                "failures": out.pop(f"peer.{peer}.failures", 0),
                "latency_s": out.pop(f"peer.{peer}.latency_s", None),
                "averaged": out.pop(f"peer.{peer}.averaged", 0),
            }
            for peer in self.peers
        }
        out["barriers"] = self._barriers.own()
        out["clock"] = self._clock
        out["state"] = self.state
        if self._store is not None:
            out["snapshot_slots"] = self._store.slots
            out["publish_skipped"] = self._store.skipped
            out["slots_retired"] = self._store.retired
        out["fetches_skipped_alone"] = self._flow.skipped_alone
        if self._bulk is not None:
            out["bulk_pending"] = self._bulk.pending()
        if self._exchange_server is not None and self._exchange_client is not None:
            out["exchanges_pending"] = self._exchange_server.held()
            out["exchanges_unsettled"] = len(self._exchange_client)
        return out

    def _check_open(self) -> None:
        if self.state in ("closing", "closed"):
            raise RuntimeError(f"dpwa node {self.name!r} is closed")

    @property
    def alive(self) -> bool:
        """True while both the Rx and the Tx thread run (they survive any message a peer sends)."""
        return bool(self._server and self._server.alive and self._client and self._client.alive)

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def close(self, timeout_s: float = 5.0) -> None:
        """Settle what is pending, stop both threads, close every socket with linger 0, free the port.

        Idempotent; bounded by about `timeout_s` per stage. A fetch in flight
        is abandoned. In mode symmetric, exchanges are settled first by the
        rule of :mod:`dpwa.gossip.exchange` (new ones refused; confirms still
        answered; in-doubt ones still asked), within `timeout_s`; committed
        halves are applied, so the model may change here. Logs an error if a
        thread is still alive after that. Shared-memory slot files are deleted.
        """
        with self._close_lock:
            if self.state in ("closing", "closed"):
                return
            self.state = "closing"
        try:
            self._abandon_step()
            if self._symmetric and self._server is not None:
                self._settle(time.monotonic() + timeout_s)
            stopped = True
            if self._server is not None:
                stopped &= self._server.close(timeout_s)
            if self._bulk is not None:  # after the server: nothing offers transfers any more
                stopped &= self._bulk.close(timeout_s)
            if self._symmetric and self._exchange_server is not None:
                self._tend()  # the last decisions the Rx thread made
                for call in self._outstanding:
                    call.abandon()
                self._outstanding.clear()
                if self._exchange_client is not None:
                    self._exchange_client.close()
                self._exchange_server.close()
            if self._joins is not None:
                self._joins.close()
            if self._direct is not None:
                self._direct.close()
            if self._client is not None:
                stopped &= self._client.close(timeout_s)
            if self._ctx is not None:
                if stopped:
                    self._ctx.term()  # every socket is closed, so this returns at once
                else:
                    logger.error("%s: leaving the ZeroMQ context open because a thread did not stop", self.name)
            if self._reader is not None:
                self._reader.close()
            if self._shared is not None:
                self._shared.close()
        finally:
            self.state = "closed"
        logger.info("%s: closed", self.name)

    def _settle(self, deadline: float) -> None:
        """Symmetric: refuse new exchanges, and wait (bounded) until what is pending is decided and known.

        Our own exchanges must be decided, and our acks sent. Those we serve: once no confirm has come for
        the quiet time, we commit no more (a late confirm is answered abort, and its requester applies
        nothing), and we keep answering the commits we made until each requester has acknowledged it.
        """
        server, client, tx = self._exchange_server, self._exchange_client, self._client
        assert server is not None and client is not None and tx is not None
        server.start_closing()
        client.send_acks()
        queries = AckQueries(server, tx.submit, self.name, self.config.timeout_s)
        frozen = False
        try:
            while time.monotonic() < deadline:
                self._tend()
                ours = bool(self._outstanding or len(client) or client.acks_pending())
                if not frozen and not ours and time.monotonic() - server.last_confirm >= SETTLE_QUIET_S:
                    server.stop_committing()
                    frozen = True
                if frozen:
                    queries.tend()
                    if not ours and not server.unacknowledged():
                        return
                time.sleep(0.01)  # a bounded polling loop: the Rx and Tx threads work meanwhile
        finally:
            queries.close()
        unacked = server.unacknowledged()
        logger.warning(
            "%s: closing with exchanges unsettled after the close deadline: %d of ours in doubt, "
            "%d commits of ours not yet known to %s",
            self.name,
            len(client),
            len(unacked),
            ", ".join(sorted({peer for peer, _ in unacked})) or "anyone",
        )

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
