"""Everything a node runs, built in order and closed in reverse on every path (an ``ExitStack``).

In order: the ZeroMQ context, shared-memory slots (when peers share this
machine), the snapshot store, the reader of peers' replies, the Tx thread
(and, for a small model in mode pull, the direct client; for a large one in
mode symmetric, the thread that streams in peers' offered snapshots), the
bulk server (for large models over TCP), what serves our snapshots, and the
join server.
The mode's own parts (symmetric exchanges) are added by their owner
(:meth:`NodeServices.own`), and the Rx thread starts last (:meth:`NodeServices.serve`),
once every route exists. :meth:`NodeServices.close` releases them in reverse: the
Rx thread stops first, the context is terminated last, and only if every
thread stopped in time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping

import zmq

from ..config import SNAPSHOT_SLOTS, Config, NodeSpec
from ..logs import RateLimitedLog, logger
from ..mixing.model import WireModel
from ..mixing.params import FlatParams
from ..stats import Counters
from ..wire.bulk import BulkServer
from ..wire.client import ClientThread, DirectClient, PeerBook
from ..wire.curve import CurveKeys
from ..wire.endpoints import is_local_host
from ..wire.schema import LARGEST_HEADER_BYTES
from ..wire.server import Route, Server
from ..wire.shm import PeerSlots, SharedMemoryError, SharedSlots
from .membership.barrier import BarrierCounts
from .membership.members import Members
from .membership.relayed import relay_client, relay_server
from .transfer.join import CHUNK_BYTES, ExtraState, JoinServer
from .transfer.paths import PeerPaths
from .transfer.protocol import NodeState
from .transfer.requesting import ReplyReader
from .transfer.serving import Serving
from .transfer.snapshots import SlotAllocator, SnapshotStore
from .transfer.validation import PeerValues

__all__ = [
    "BULK_MIN_BYTES",
    "DIRECT_MAX_BYTES",
    "MAX_SNAPSHOT_SLOTS",
    "OPEN_PEERS_BUDGET",
    "UNSENT_PER_CLIENT",
    "NodeServices",
]

MAX_SNAPSHOT_SLOTS = max(SNAPSHOT_SLOTS)  # the most snapshot slots a node has (`snapshot_slots`, docs/design.md#memory)
UNSENT_PER_CLIENT = 3  # replies with a payload one client may leave unsent (ZeroMQ reports "sent" a little late)
# Pull-mode fetches of models up to this size from peers on other machines run on the training thread
# (DirectClient): two thread wake-ups cost more than checking a small reply; larger ones are received
# and checked on the Tx thread, in parallel with training.
DIRECT_MAX_BYTES = 1 << 20
# Over TCP, snapshots of at least this size stream over raw TCP (dpwa.wire.bulk, config key `bulk`).
BULK_MIN_BYTES = 4 << 20
# With open membership the number of peers is not known at start: the budgets sized by it (unsent replies, the
# bulk server's connections) are sized for at least this many
OPEN_PEERS_BUDGET = 8


class NodeServices:
    """The services of one node: its sockets, threads and snapshot slots. Every attribute exists once the
    constructor returns; ``shared``, ``direct`` and ``bulk`` are None when this node does not use them.

    Args:
        name, config, spec: this node, its cluster, its entry.
        params, model: the model, and how it looks on the wire.
        curve: our CURVE keys, or None without them.
        counters: the node's counters.
        barriers: our barrier counts (the join server reads them).
        state: reads the node's state (the join server reports it).
        extra: what a joiner takes besides the parameters (an optimizer's state).
        direct: use a direct client (mode pull).
        stream_to_peers: ask peers for streams of their snapshots (a fetch, or an exchange's reply).
        exchange_streams: read peers' snapshots offered with their exchanges (mode symmetric), on a thread of
            its own (``streams_in``).
        carry: the scalars the node's rule sends with each fetch it serves (dpwa.mixing.rules), or None.
        members: open membership's view (``bootstrap:``): digests travel with snapshots, requests are accepted
            from its members, and the clients' address book (``endpoints``) follows it. None: the config's nodes.
        heard: told of a peer each time it shows it is alive: a reply of it (a late one included) reaches a
            client, or a request of it passes the Rx thread's checks (flow control's signs of life).
    """

    def __init__(
        self,
        *,
        name: str,
        config: Config,
        spec: NodeSpec,
        params: FlatParams,
        model: WireModel,
        curve: CurveKeys | None,
        counters: Counters,
        barriers: BarrierCounts,
        state: Callable[[], NodeState],
        extra: ExtraState | None,
        direct: bool,
        stream_to_peers: bool,
        exchange_streams: bool = False,
        carry: Callable[[int], dict[str, float]] | None = None,
        members: Members | None = None,
        heard: Callable[[str], None] | None = None,
    ) -> None:
        self.name, self.config, self.spec, self.curve = name, config, spec, curve
        self._heard = heard
        self.members = members
        self.peers = {s.name: s for s in config.peers_of(name)}  # the config's (open membership: the first view)
        budgeted = max(len(self.peers), OPEN_PEERS_BUDGET) if members is not None else len(self.peers)
        self._counters = counters
        self._stopped = True  # every thread stopped in time (else the context is left open)
        self._timeout_s = 5.0  # how long each thread is given to stop (close() says)
        self._log = RateLimitedLog()
        self._params, self._model = params, model
        self._budgeted = budgeted
        with contextlib.ExitStack() as stack:
            self.context = zmq.Context()
            stack.callback(self._term)
            # every listener (ZeroMQ and bulk) binds the same address, resolved once
            self.address = config.bind_address(spec) if config.transport == "tcp" else ""
            # relays (TCP only): the one this node runs for members nobody can dial, and its own way in if it is one
            certifier = members.certifier if members is not None else None
            self.relay = relay_server(config, self.address, curve, certifier, counters, name)
            if self.relay is not None:
                stack.callback(self._stop, self.relay.close)
            self.relayed = relay_client(config, spec, self.address, curve, counters)
            if self.relayed is not None:
                stack.callback(self._stop, self.relayed.close)
            local = self._same_host_peers()
            self.local = tuple(local)  # same-host peers: their slots can be read (slot_readers)
            unsent = UNSENT_PER_CLIENT * (budgeted + 1)  # each sender its own budget
            self.store = SnapshotStore(
                params.size,
                model.storage,
                max_slots=config.snapshot_slots,
                rewrite_in_place=config.mode == "symmetric",  # a spent snapshot is refused anyway
                memory=SlotAllocator(params.size, model.storage, params.allocate, self.shared, name),
                hold_limit_s=config.timeout_s + 1.0,
                max_retired=unsent,
            )
            self.values = PeerValues(model.kept, config.max_peer_distance, self.store.lease)
            # a compressing codec (int8, topk): snapshots are kept in float32 and encoded as they are sent
            self.sender = model.codec.sender(peers=len(self.peers))
            self.bulk: BulkServer | None = None
            if config.bulk == "auto" and config.transport == "tcp" and model.nbytes >= BULK_MIN_BYTES:
                self.bulk = BulkServer(
                    self.address,
                    sealed=config.secure,  # with keys, every stream is sealed with a key of its own
                    name=name,
                    counters=counters,
                    max_per_sender=UNSENT_PER_CLIENT,
                    max_pending=unsent,
                    max_connections=4 * (budgeted + 1),
                )
                stack.callback(self._stop, self.bulk.close)  # after the Rx thread: nothing offers transfers any more
            streams = self.bulk is not None and (stream_to_peers or exchange_streams)
            # how each peer's snapshots travel (one place decides: dpwa.gossip.transfer.paths): a same-host peer's by
            # slot; a large model's between hosts by stream, but with a peer nobody can dial (behind a relay) or,
            # offered by us, when nobody can dial us
            bulk_hosts = {p: s.host for p, s in self.peers.items() if p not in local and s.reachable} if streams else {}
            self.paths = PeerPaths(local, bulk_hosts, offers_streams=spec.reachable)
            self.reader = ReplyReader(
                model,
                self.values,
                self.slot_readers(),
                counters,
                functools.partial(self._info, name),
                paths=self.paths,
                sealed=config.secure,
                name=name,
                peers=len(self.peers),
                members=members,
                spare=self.store.borrow,  # a peer's snapshot is received into our slot nobody holds, if any
            )
            stack.callback(self.reader.close)  # after the threads that read with it have stopped
            options = None
            if curve is not None:
                options = {
                    p: curve.client_options(s.public_key.encode()) for p, s in self.peers.items() if s.public_key
                }
            # where each peer is: changed as members come and go (open membership), read by every client
            self.endpoints = endpoints = PeerBook({peer: config.endpoint(s) for peer, s in self.peers.items()})
            max_reply = max(model.nbytes, LARGEST_HEADER_BYTES, CHUNK_BYTES)
            self.client = ClientThread(
                self.context, endpoints, name=name, max_reply_bytes=max_reply, socket_options=options, heard=heard
            )
            self.client.start()
            stack.callback(self._stop, self.client.close)
            # Mode symmetric, large models between hosts: the snapshots peers offer with their exchanges are
            # streamed in by a thread of their own (never the Tx thread: it may be waiting on that same peer).
            self.streams_in: tuple[ClientThread, ReplyReader] | None = None
            if exchange_streams and bulk_hosts:
                in_reader = ReplyReader(
                    model,
                    self.values,
                    {},
                    counters,
                    functools.partial(self._info, name),
                    paths=self.paths,
                    sealed=config.secure,
                    name=name,
                    spare=self.store.borrow,
                )
                stack.callback(in_reader.close)
                in_client = ClientThread(
                    self.context, endpoints, name=f"{name}-in", max_reply_bytes=max_reply, socket_options=options
                )
                in_client.start()
                stack.callback(self._stop, in_client.close)
                self.streams_in = (in_client, in_reader)
            self.direct: DirectClient | None = None
            if direct and model.nbytes <= DIRECT_MAX_BYTES:
                self.direct = DirectClient(
                    self.context, endpoints, name=name, max_reply_bytes=max_reply, socket_options=options, heard=heard
                )
                stack.callback(self.direct.close)
            self.serving = Serving(
                name,
                self.store,
                model,
                self.shared.id if self.shared else None,
                counters,
                bulk=self.bulk,
                bulk_ttl_s=config.timeout_s + 1.0,
                sender=self.sender,
                carry=carry,
                members=members,
            )
            askers = members if members is not None else list(self.peers)  # who may join from us
            self.joins = JoinServer(name, self.store, model, barriers, state, extra, askers)
            stack.callback(self.joins.close)
            self._stack = stack.pop_all()

    @staticmethod
    def _info(name: str, message: str) -> None:
        logger.info("%s: %s", name, message)

    def slot_readers(self) -> dict[str, PeerSlots]:
        """A fresh reader of each same-host peer's slots, for one thread (the caller owns and closes them)."""
        return {peer: PeerSlots(peer, self.peers[peer].port) for peer in self.local}

    def _same_host_peers(self) -> list[str]:
        """Peers on this machine whose snapshots we read from shared memory (and who read ours)."""
        self.shared: SharedSlots | None = None
        if self.config.same_host == "off":
            return []
        local = [peer for peer, spec in self.peers.items() if is_local_host(spec.host)]
        if not local:
            return []
        try:
            self.shared = SharedSlots(self.name, self.spec.port, self._model.kept_nbytes, self._model.storage)
        except (SharedMemoryError, OSError) as exc:
            logger.warning("%s: same-host peers will use TCP: shared memory is unavailable: %s", self.name, exc)
            return []
        logger.info("%s: same-host path (shared memory) for %s", self.name, ", ".join(local))
        return local

    # ----------------------------------------------------------------- adding the last parts

    def own(self, close: Callable[[], object]) -> None:
        """Release something at close, before what was built so far (after the Rx thread is stopped)."""
        self._stack.callback(close)

    def serve(self, routes: Mapping[str, Route]) -> None:
        """Start the Rx thread with every route: the last part, and the first to stop."""
        self.server = Server(
            self.context,
            self.config.bind_endpoint(self.spec, self.address),
            routes,
            name=self.name,
            counters=self._counters,
            curve=self.curve,
            # who may ask (their `from`): the config's nodes; with open membership any name, and the handlers
            # that serve only members check it (Serving.check_request: a newcomer may introduce itself; joins)
            senders=None if self.members is not None else [spec.name for spec in self.config.nodes],
            max_unsent_per_client=UNSENT_PER_CLIENT,
            max_unsent=UNSENT_PER_CLIENT * (self._budgeted + 1),
            heard=self._heard,
        ).start()
        self._stack.callback(self._stop, self.server.close)

    # ----------------------------------------------------------------- the training thread

    def publish(self, clock: float, loss: float | None) -> bool:
        """Copy the model into a snapshot peers are served; capture the extra state if a joiner waits. False:
        every slot was held, and peers are served the previous snapshot."""
        fill = functools.partial(self._params.copy_to, wire=self._model.kept)
        self.joins.expire()  # a join offer read to its end lets its slot go
        published = self.store.publish(fill, clock, loss)
        if not published:
            self._log(  # info: with two slots, a send still under way when the next step publishes is common
                20,
                "publish_skipped",
                "%s: every snapshot slot is held by readers; peers get the previous snapshot",
                self.name,
            )
        self.joins.capture_if_wanted()  # a peer is joining: our optimizer state, paired with this snapshot
        return published

    # ----------------------------------------------------------------- closing

    def _stop(self, close: Callable[[float], bool], timeout_s: float | None = None) -> None:
        if not close(self._timeout_s if timeout_s is None else timeout_s):
            self._stopped = False

    def _term(self) -> None:
        if self.shared is not None:
            self.shared.close()
        if self._stopped:
            self.context.term()  # every socket is closed, so this returns at once
        else:
            logger.error("%s: leaving the ZeroMQ context open because a thread did not stop", self.name)

    def close(self, timeout_s: float = 5.0) -> None:
        """Release every part, the Rx thread first; each thread is given `timeout_s` to stop."""
        self._timeout_s = timeout_s
        self._stack.close()
