"""A dpwa node: one model, an Rx thread that serves it, a Tx thread that fetches peers.

The training thread calls :meth:`Node.update_send` before each batch and
:meth:`Node.update_wait` after it::

    with Node("cluster.yaml", "w1", NumpyParams(weights)) as node:
        for batch in batches:
            node.update_send(loss)     # publish a snapshot; maybe start a fetch
            loss = train(batch)        # the fetch runs meanwhile on the Tx thread
            node.update_wait(loss)     # blend the fetched parameters in place

Publishing copies the model once into a free snapshot slot; the Rx thread
serves the latest slot to any peer that asks, without a copy and without
ever making the training thread wait. The Tx thread fetches from one peer
chosen by :class:`~dpwa.peers.PeerSelector`, validates the reply, and hands the
received buffer to ``update_wait``, which blends it in on the training thread
(the only thread that writes the model).

Peers on the same machine exchange through shared memory (:mod:`dpwa.shm`)
instead of TCP when ``same_host: auto`` (the default): the request still goes
over ZeroMQ, but the reply names a snapshot slot that the peer reads in place.

How a fetched snapshot changes the model is decided by :mod:`dpwa.mixing`
(``blend: state | delta``). With ``mode: symmetric`` the request carries our
snapshot too, and the peer applies the mirror image of our correction once we
confirm (:mod:`dpwa.exchange`), so the mean of all nodes is kept.
"""

from __future__ import annotations

import functools
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import zmq
from zmq.utils import z85

from . import interpolation as interp
from . import kernels, mixing
from .config import Config, ConfigError, load_config, parse_config, pointless_settings
from .logs import RateLimitedLog, logger
from .params import FlatParams
from .peers import PeerSelector
from .protocol import MAX_HEADER_BYTES, Header, ProtocolError, check_payload, encode_header
from .exchange import Pending, PendingExchanges
from .keys import KeyFileError, load_secret
from .shm import PeerSlots, SharedMemoryError, SharedSlots
from .snapshot import Lease, SnapshotStore
from .stats import Counters
from .transport import Curve, Reply, Request, RequestTimeout, Server, is_local_host
from .tx import Job, TxWorker

__all__ = ["Node", "Update", "WAIT_SLACK_S"]

WAIT_SLACK_S = 0.2  # update_wait returns at most this long after a fetch's deadline
MAX_SNAPSHOT_SLOTS = 6  # model copies kept for readers at most; past that, publishing is skipped
SHM_ATTEMPTS = 4  # same-host fetches asked again when the slot was rewritten before we locked it
EXCHANGE_TTL_MARGIN_S = 1.0  # an unconfirmed symmetric exchange is dropped this long after the deadline
ALONE_BACKOFF_MAX_S = 30.0  # when every peer fails, probe at most this rarely (the interval doubles up to it)
UNREACHABLE_AFTER = 2  # consecutive timeouts or transport failures that make a peer count as unreachable


@dataclass(frozen=True)
class Update:
    """What one update_wait did, for logging."""

    averaged: bool  # True if a peer's parameters were blended in
    outcome: str  # ok | no_fetch | timeout | refused | rejected | failed | cancelled
    peer: str | None = None  # the peer fetched from, if any
    factor: float | None = None  # f in params = f * peer + (1 - f) * params, when averaged
    reason: str = ""  # why not averaged, in words
    latency_s: float | None = None  # fetch time, when a fetch finished
    clock: float = 0.0  # this node's clock after the update


@dataclass(eq=False)
class _Committed:
    """Our half of a confirmed symmetric exchange, waiting for update_wait."""

    peer: str
    received: "_Received"  # the peer's snapshot s_j
    own: Lease  # our snapshot s_i, as sent
    f: float

    def release(self) -> None:
        self.received.release()
        self.own.release()


class _Received:
    """A fetched snapshot held for blending: its header, its elements, and how to let go of them."""

    __slots__ = ("header", "array", "_release")

    def __init__(self, header: Header, array: np.ndarray, release: Callable[[], None]) -> None:
        self.header, self.array, self._release = header, array, release

    def release(self) -> None:
        """Give the memory back (a frame to the Tx thread, a shared slot's lock). Idempotent."""
        release, self._release = self._release, None
        self.array = None
        if release is not None:
            release()


def _as_config(config: Config | str | os.PathLike[str] | Mapping[str, Any] | list) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    if isinstance(config, (Mapping, list)):
        return parse_config(config, source="<dict>")
    raise ConfigError(f"config must be a Config, a file path or parsed YAML data, got {type(config).__name__}")


def _loss_value(loss: Any) -> float | None:
    """A reported loss as a float, or None if it is unknown (None, NaN, Inf)."""
    if loss is None:
        return None
    try:
        value = float(loss.item() if hasattr(loss, "item") else loss)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"loss must be a number, a 0-d tensor or None, got {type(loss).__name__}") from exc
    return value if math.isfinite(value) else None


class Node:
    """One participant of pairwise gossip averaging.

    Args:
        config: a :class:`Config`, a path to a YAML file, or parsed YAML data.
        name: which node of the config this process is.
        params: the model as a :class:`~dpwa.params.FlatParams`.
        rng: randomness for fetch decisions and peer choice (seed it for tests).
    """

    def __init__(
        self,
        config: Config | str | os.PathLike[str] | Mapping[str, Any] | list,
        name: str,
        params: FlatParams,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.config = _as_config(config)
        self.spec = self.config.node(name)  # raises before any socket exists
        self.name = name
        self.params = params
        self.peers = {spec.name: spec for spec in self.config.peers_of(name)}
        self.wire = self.config.wire_dtype
        self._storage = kernels.storage_dtype(self.wire)
        self.nbytes = params.size * self._storage.itemsize  # bytes of one snapshot on the wire
        self._rng = rng or random.Random()
        self._interpolation = interp.from_config(self.config)
        self._blend = mixing.from_config(self.config)
        self._symmetric = self.config.mode == "symmetric"
        self._selector = PeerSelector(list(self.peers), rng=self._rng)
        self.counters = Counters()
        self._log = RateLimitedLog()
        self._clock = 0.0
        self._pending_batch: float | None = None  # set by update_send, consumed by update_wait
        self._send_loss: float | None = None
        self._job: Job | None = None
        self._own: Lease | None = None  # our snapshot of this step, when the blend needs it (pull mode)
        self._committed: list[_Committed] = []  # symmetric: our confirmed halves, for update_wait
        self._committed_lock = threading.Lock()
        self._exchanges = PendingExchanges(ttl_s=self.config.timeout_s + EXCHANGE_TTL_MARGIN_S,
                                           capacity=2 * len(self.peers) + 2)  # served, waiting to be applied
        self._exchange_uses: dict[int, int] = {}  # snapshot version -> exchanges it served (Rx thread)
        self._closed = False
        self._close_lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._server: Server | None = None
        self._tx: TxWorker | None = None
        self._shared: SharedSlots | None = None
        self._readers: dict[str, PeerSlots] = {}  # same-host peers whose slots we may read
        self._misses: dict[str, int] = {peer: 0 for peer in self.peers}  # consecutive timeouts/failures
        self._alone = False  # every peer is unreachable: we said so once
        self._backoff_s = 0.0  # while alone: the interval between probes
        self._next_probe = 0.0  # while alone: time.monotonic() of the next fetch attempt
        curve = self._load_curve()  # key problems are reported before any socket exists

        logger.info("%s: starting on %s; %s", name, self.spec.bind_endpoint, self.config.describe())
        for note in pointless_settings(self.config):
            logger.warning("%s: %s", name, note)
        try:
            self._setup_same_host()
            self._store = SnapshotStore(
                params.size, self._storage, max_slots=MAX_SNAPSHOT_SLOTS, allocate=params.allocate,
                memory=self._shared.allocate if self._shared else None,
            )
            self._ctx = zmq.Context()
            handlers = {"fetch": self._serve_fetch}
            if self._symmetric:
                handlers.update(exchange=self._serve_exchange, confirm=self._serve_confirm)
            self._server = Server(
                self._ctx, self.spec.bind_endpoint, handlers, name=name, counters=self.counters, curve=curve,
                max_request_bytes=max(self.nbytes, MAX_HEADER_BYTES) if self._symmetric else MAX_HEADER_BYTES,
            ).start()
            self._tx = TxWorker(
                self._ctx, {peer: spec.endpoint for peer, spec in self.peers.items()},
                name=name, on_done=self._job_done,
                max_reply_bytes=max(self.nbytes, MAX_HEADER_BYTES),
                socket_options={peer: curve.client_options(spec.public_key.encode())
                                for peer, spec in self.peers.items()} if curve else None,
            ).start()
        except BaseException:
            self.close()
            raise

    def _load_curve(self) -> Curve | None:
        if not self.config.secure:
            return None
        if self.spec.secret_key_file is None:
            raise ConfigError(f"{self.config.source}: node {self.name!r} has a public_key but no "
                              "secret_key_file: it cannot prove who it is")
        try:
            pair = load_secret(self.spec.secret_key_file, self.spec.public_key)
        except KeyFileError as exc:
            raise ConfigError(f"{self.config.source}: node {self.name!r}: {exc}") from None
        allowed = {z85.decode(spec.public_key.encode()): spec.name for spec in self.config.nodes}
        return Curve(public=pair.public, secret=pair.secret, allowed=allowed)

    def _setup_same_host(self) -> None:
        if self.config.same_host == "off":
            return
        local = [peer for peer, spec in self.peers.items() if is_local_host(spec.host)]
        if not local:
            return
        try:
            self._shared = SharedSlots(self.name, self.spec.port, self.nbytes, self._storage)
        except (SharedMemoryError, OSError) as exc:
            logger.warning("%s: same-host peers will use TCP: shared memory is unavailable: %s", self.name, exc)
            return
        self._readers = {peer: PeerSlots(peer, self.peers[peer].port) for peer in local}
        logger.info("%s: same-host path (shared memory) for %s", self.name, ", ".join(local))

    # ----------------------------------------------------------------- training thread

    def update_send(self, loss: Any = None, batch_size: float = 1) -> bool:
        """Publish the current parameters, clock and loss; maybe start a fetch.

        Call it before each batch. `batch_size` is added to the clock once the
        batch is done (the default 1 makes the clock count batches). Returns
        True if a fetch was started; :meth:`update_wait` collects it.
        """
        self._check_open()
        if not (isinstance(batch_size, (int, float)) and batch_size >= 0) or isinstance(batch_size, bool):
            raise ValueError(f"batch_size must be a number >= 0, got {batch_size!r}")
        if self._pending_batch is not None:  # update_wait was skipped: count the batch, drop the fetch
            self._abandon_step()
        self._send_loss = _loss_value(loss)
        self._pending_batch = float(batch_size)
        if self._symmetric:  # the request carries our snapshot: publish it first
            self._publish()
            return self._start_exchange()
        # Start the fetch first: it does not need our snapshot, so the copy overlaps with the request.
        started = self._start_fetch()
        self._publish()
        if started and isinstance(self._blend, mixing.DeltaBlend):
            self._own = self._store.lease()  # the snapshot the delta is taken from
        return started

    def _publish(self) -> None:
        publish = functools.partial(self.params.copy_to, wire=self.wire)
        if not self._store.publish(publish, self._clock, self._send_loss):
            self._log(30, "publish_skipped", "%s: every snapshot slot is held by slow readers; "
                      "peers get the previous snapshot", self.name)

    def _fetch_decision(self) -> str | None:
        """The peer to ask this step, or None (no peers, the coin said no, or backing off)."""
        if not self.peers or self._rng.random() >= self.config.fetch_probability:
            return None
        if self._alone:  # every peer failed last time: probe now and then instead of every step
            now = time.monotonic()
            if now < self._next_probe:
                self.counters.add("fetches_skipped_alone")
                return None
            self._backoff_s = min(ALONE_BACKOFF_MAX_S, max(self.config.timeout_s, 2 * self._backoff_s))
            self._next_probe = now + self._backoff_s
        return self._selector.choose()

    def _request_fields(self, peer: str) -> dict[str, Any]:
        fields: dict[str, Any] = {"from": self.name, "fp": self.params.fingerprint, "dtype": self.wire}
        if peer in self._readers:
            fields["shm"] = True
        return fields

    def _start_fetch(self) -> bool:
        peer = self._fetch_decision()
        if peer is None:
            return False
        fields = self._request_fields(peer)
        self._submit(Job(
            peer=peer,
            make_frames=lambda request_id: [encode_header("fetch", request_id, **fields)],
            deadline=time.monotonic() + self.config.timeout_s,
            validate=functools.partial(self._receive, peer=peer),
            # a same-host slot rewritten between the reply and our lock: just ask again
            retry_on=frozenset({"shm_stale", "shm_busy"}),
            max_attempts=SHM_ATTEMPTS,
        ))
        return True

    def _start_exchange(self) -> bool:
        peer = self._fetch_decision()
        if peer is None:
            return False
        own = self._store.lease()
        if own is None:  # nothing published (every slot held at our first publish): nothing to offer
            return False
        snap = own.snapshot
        fields = {**self._request_fields(peer), "nbytes": self.nbytes, "clock": snap.clock, "loss": snap.loss}
        self._submit(Job(
            peer=peer,
            make_frames=lambda request_id: [encode_header("exchange", request_id, **fields), snap.array],
            deadline=time.monotonic() + self.config.timeout_s,
            validate=functools.partial(self._receive_exchange, peer=peer, own=own),
            retry_on=frozenset({"shm_stale", "shm_busy"}),
            max_attempts=SHM_ATTEMPTS,
            kind="exchange",
            context=own,  # the Tx thread owns this lease until the exchange commits or fails
        ))
        return True

    def _submit(self, job: Job) -> None:
        self._job = job
        self.counters.add("fetches_started")
        self._tx.submit(job)

    def update_wait(self, loss: Any = None) -> Update:
        """Finish the step: wait for the fetch started by update_send, if any, and blend it in.

        Returns at once when no fetch was started, and never waits longer than
        ``timeout_ms`` plus a small slack. When the fetch failed the
        parameters are left as they are. `loss` is this batch's loss (the
        loss given to update_send is used when it is None).
        """
        self._check_open()
        if self._pending_batch is not None:
            self._clock += self._pending_batch
            self._pending_batch = None
        own_loss = _loss_value(loss)
        if own_loss is None:
            own_loss = self._send_loss
        self._apply_mirrors()
        job, self._job = self._job, None
        try:
            failed = self._wait(job)
            if self._symmetric:
                return self._apply_committed(job, failed)
            if failed is not None:
                return failed
            return self._apply_fetch(job, own_loss)
        finally:
            if self._own is not None:
                self._own.release()
                self._own = None

    def _wait(self, job: Job | None) -> Update | None:
        """Wait for `job`; None if it succeeded, else the Update that says why not."""
        if job is None:
            return Update(False, "no_fetch", reason="no fetch was started this step", clock=self._clock)
        if not job.done.wait(max(0.0, job.deadline + WAIT_SLACK_S - time.monotonic())):
            job.abandon()
            return Update(False, "timeout", job.peer, reason="the Tx thread did not finish in time",
                          clock=self._clock)
        if job.outcome != "ok":
            return Update(False, job.outcome, job.peer, reason=job.reason, latency_s=job.latency_s,
                          clock=self._clock)
        return None

    def _apply_fetch(self, job: Job, own_loss: float | None) -> Update:
        received: _Received = job.take()
        own = self._own.snapshot if self._own is not None else None
        try:
            peer_clock, peer_loss = received.header["clock"], received.header["loss"]
            f = self._interpolation.factor(self._clock, peer_clock, own_loss, peer_loss)
            f = interp.damp_by_divergence(f, own_loss, self.config.divergence_threshold)
            self._blend.apply(self.params, own.array if own else None, received.array, f, self.wire)
        finally:
            received.release()
        self._clock = self._blend.clock(self._clock, own.clock if own else 0.0, peer_clock, f)
        self.counters.add("averaged")
        return Update(True, "ok", job.peer, factor=f, latency_s=job.latency_s, clock=self._clock)

    def _apply_committed(self, job: Job | None, failed: Update | None) -> Update:
        """Apply our halves of every confirmed exchange: this step's, and any confirmed after
        an earlier update_wait had stopped waiting (a confirmed half is never dropped)."""
        with self._committed_lock:
            committed, self._committed = self._committed, []
        last: _Committed | None = None
        for item in committed:
            try:
                peer_clock = item.received.header["clock"]
                self._blend.apply(self.params, item.own.snapshot.array, item.received.array, item.f, self.wire)
                self._clock = self._blend.clock(self._clock, item.own.snapshot.clock, peer_clock, item.f)
            finally:
                item.release()
            self.counters.add("averaged")
            last = item
        if last is None:
            return failed if failed is not None else Update(False, "failed", job.peer if job else None,
                                                              reason="the exchange was not confirmed",
                                                              clock=self._clock)
        latency = job.latency_s if job is not None and failed is None else None
        return Update(True, "ok", last.peer, factor=last.f, latency_s=latency, clock=self._clock)

    def _apply_mirrors(self) -> None:
        """Apply the server halves of the symmetric exchanges peers have confirmed."""
        for pending in self._exchanges.take_confirmed():
            try:
                mixing.mirror(self.params, pending.served.snapshot.array, pending.requester, pending.f, self.wire)
                self._clock = mixing.mirror_clock(self._clock, pending.served.snapshot.clock,
                                                  pending.requester_clock, pending.f)
            finally:
                pending.release()
            self.counters.add("mirrored")

    def _abandon_step(self) -> None:
        self._clock += self._pending_batch or 0.0
        self._pending_batch = None
        if self._job is not None:
            self._job.abandon()
            self._job = None
            self.counters.add("fetches_abandoned")
        if self._own is not None:
            self._own.release()
            self._own = None

    @property
    def clock(self) -> float:
        """Samples (or batches) trained, blended with peers' clocks at each average."""
        return self._clock

    # ----------------------------------------------------------------- Tx thread

    def _receive(self, header: Header, rest: list[zmq.Frame], ask: Any = None, *, peer: str) -> _Received:
        """Validate a reply to a fetch and take hold of its parameters (frame or shared slot)."""
        if header.kind != "params":
            raise ProtocolError("bad_reply", f"expected a params reply, got {header.kind!r}")
        if "shm_slot" in header.fields:
            reader = self._readers.get(peer)
            if reader is None or rest or "shm_id" not in header.fields or "version" not in header.fields:
                raise ProtocolError("bad_reply", "a shared-memory reply that was not asked for, or incomplete")
            check_payload(header, None, fp=self.params.fingerprint, dtype=self.wire, nbytes=self.nbytes)
            try:
                view = reader.acquire(header["shm_id"], header["shm_slot"], header["version"], self.nbytes,
                                      self._storage)
            except ProtocolError as exc:
                if exc.reason == "shm_unavailable":  # e.g. the peer runs as another user: use TCP from now on
                    self._readers.pop(peer, None)
                    logger.info("%s: %s: falling back to TCP for %s", self.name, exc.detail, peer)
                raise
            self.counters.add("same_host_fetches")
            return self._checked(_Received(header, view.array, view.release))
        if len(rest) != 1:
            raise ProtocolError("bad_reply", f"expected one payload frame, got {len(rest)}")
        frame = rest[0]
        check_payload(header, frame.buffer, fp=self.params.fingerprint, dtype=self.wire, nbytes=self.nbytes)
        array = np.frombuffer(frame.buffer, dtype=self._storage)
        self.counters.add("bytes_in", self.nbytes)
        # Unmapping a large frame takes milliseconds: the Tx thread frees it, off the training thread.
        return self._checked(_Received(header, array, functools.partial(self._tx.discard, frame)))

    def _checked(self, received: _Received) -> _Received:
        """Refuse parameters that must never be blended: NaN or Inf, or implausibly far from ours."""
        try:
            self._check_values(received.array)
        except BaseException:
            received.release()
            raise
        return received

    def _check_values(self, array: np.ndarray) -> None:
        if not kernels.all_finite(array, self.wire):
            raise ProtocolError("not_finite", "the parameters contain NaN or Inf")
        limit = self.config.max_peer_distance
        if limit > 0:
            lease = self._store.lease()
            if lease is not None:
                with lease:
                    distance = kernels.relative_distance(array, lease.snapshot.array, self.wire)
                if distance > limit:
                    raise ProtocolError("too_far", f"||peer - ours|| / ||ours|| = {distance:.3g} "
                                        f"exceeds max_peer_distance {limit:g}")

    def _receive_exchange(self, header: Header, rest: list[zmq.Frame], ask: Any, *, peer: str, own: Lease) -> bool:
        """Validate the peer's snapshot, confirm the exchange, and queue our half for update_wait."""
        received = self._receive(header, rest, peer=peer)
        try:
            snap = own.snapshot
            f = self._interpolation.factor(snap.clock, header["clock"], snap.loss, header["loss"])
            f = interp.damp_by_divergence(f, snap.loss, self.config.divergence_threshold)
            self._confirm(ask, header.id, f)
        except BaseException:
            received.release()
            raise
        with self._committed_lock:
            self._committed.append(_Committed(peer, received, own, f))
        self.counters.add("exchanges_confirmed")
        return True

    def _confirm(self, ask: Any, xid: int, f: float) -> None:
        """Tell the server to apply its half; ask again if an ack is lost (a confirm is idempotent)."""
        for attempt in range(2):
            deadline = None if attempt else time.monotonic() + self.config.timeout_s / 4
            try:
                reply, _ = ask(lambda rid: [encode_header("confirm", rid, **{"from": self.name}, xid=xid, f=f)],
                               deadline=deadline)
            except RequestTimeout:
                if attempt:
                    raise
                continue
            if reply.kind == "ack":
                return
            detail = f"{reply['reason']}: {reply['detail']}" if reply.kind == "error" else reply.kind
            raise ProtocolError("not_confirmed", f"the peer did not take the exchange: {detail}")

    def _job_done(self, job: Job) -> None:
        if job.kind == "exchange" and job.outcome != "ok":
            job.context.release()  # our snapshot was only held for this exchange
        if job.outcome == "cancelled":
            self.counters.add("fetches_cancelled")
            return
        if job.outcome in ("timeout", "failed"):
            self._misses[job.peer] += 1
        else:  # any reply, even a refusal, shows the peer is alive
            self._misses[job.peer] = 0
            if self._alone:
                self._alone = False
                self._backoff_s = 0.0
                logger.warning("%s: %s answered: averaging again", self.name, job.peer)
        if job.outcome == "refused" and job.refusal == "busy":  # a healthy peer with its hands full
            self.counters.add("fetches_busy")
            return
        if job.outcome == "ok":
            self._selector.success(job.peer)
            self.counters.add("fetches_ok")
            if job.retries:
                self.counters.add("same_host_retries", job.retries)
            self.counters.set("last_fetch_latency_s", job.latency_s)
            return
        self._selector.failure(job.peer)
        if not self._alone and all(m >= UNREACHABLE_AFTER for m in self._misses.values()):
            self._alone = True
            self._next_probe = time.monotonic() + self.config.timeout_s
            logger.warning("%s: none of the %d peers answered its last %d fetches; training alone, "
                           "and trying a peer now and then (at most every %.0f s) until one answers",
                           self.name, len(self.peers), UNREACHABLE_AFTER, ALONE_BACKOFF_MAX_S)
        key = {"timeout": "fetches_timed_out", "rejected": "fetches_rejected",
               "refused": "fetches_refused"}.get(job.outcome, "fetches_failed")
        self.counters.add(key)
        self.counters.add(f"peer.{job.peer}.failures")
        self._log(30, (job.peer, job.outcome), "%s: fetch from %s %s: %s",
                  self.name, job.peer, job.outcome, job.reason)

    # ----------------------------------------------------------------- Rx thread

    def _check_request(self, header: Header) -> None:
        if header["fp"] != self.params.fingerprint:
            raise ProtocolError("bad_fingerprint", f"requester's model fingerprint {header['fp'].hex()} "
                                f"differs from ours {self.params.fingerprint.hex()}")
        if header["dtype"] != self.wire:
            raise ProtocolError("bad_dtype", f"requester wants {header['dtype']!r}, this node sends {self.wire!r} "
                                "(do the nodes share one config?)")

    def _serve_fetch(self, request: Request) -> Reply:
        self._check_request(request.header)
        lease = self._store.lease()
        if lease is None:
            return self._not_ready(request.header)
        return self._params_reply(request.header, lease)

    def _not_ready(self, header: Header) -> Reply:
        return Reply(encode_header("error", header.id, reason="not_ready", detail="no snapshot published yet"))

    def _params_reply(self, header: Header, lease: Lease) -> Reply:
        """Our snapshot for a requester: a zero-copy frame, or the name of a shared-memory slot."""
        snap = lease.snapshot
        fields = {"from": self.name, "fp": self.params.fingerprint, "dtype": self.wire, "nbytes": self.nbytes,
                  "clock": snap.clock, "loss": snap.loss, "version": snap.version}
        if header.fields.get("shm") and self._shared is not None:
            # The peer locks the slot's file and checks its version itself: if we
            # rewrite the slot before it locks it, it sees a newer version and
            # rejects it; once it holds the lock, we cannot rewrite it.
            lease.release()
            self.counters.add("same_host_served")
            return Reply(encode_header("params", header.id, **fields, shm_slot=snap.slot, shm_id=self._shared.id))
        return Reply(encode_header("params", header.id, **fields), payload=snap.array, lease=lease)

    def _serve_exchange(self, request: Request) -> Reply:
        header = request.header
        self._check_request(header)
        if len(request.payload) != 1:
            raise ProtocolError("bad_request", f"an exchange carries one payload frame, got {len(request.payload)}")
        frame = request.payload[0]
        check_payload(header, frame.buffer, fp=self.params.fingerprint, dtype=self.wire, nbytes=self.nbytes)
        theirs = np.frombuffer(frame.buffer, dtype=self._storage)
        self._check_values(theirs)
        served = self._store.lease()
        if served is None:
            return self._not_ready(header)
        version = served.snapshot.version
        self._exchange_uses = {version: self._exchange_uses.get(version, 0)}  # forget older snapshots
        if self._exchange_uses[version] >= mixing.EXCHANGES_PER_SNAPSHOT:
            served.release()  # see dpwa.mixing: more exchanges on one snapshot would overshoot
            return Reply(encode_header("error", header.id, reason="busy",
                                       detail="this snapshot already serves an exchange; ask another peer"))
        self._exchange_uses[version] += 1
        pending = Pending(
            xid=header.id, peer=header["from"], requester=theirs, requester_clock=header["clock"],
            served=served, expires=time.monotonic() + self._exchanges.ttl_s,
            release_requester=functools.partial(self._tx.discard, frame),
        )
        if not self._exchanges.add(pending):
            served.release()
            return Reply(encode_header("error", header.id, reason="busy",
                                       detail=f"{self._exchanges.capacity} exchanges are waiting to be applied"))
        return self._params_reply(header, served.share())

    def _serve_confirm(self, request: Request) -> Reply:
        header = request.header
        f = header["f"]
        if not 0.0 <= f <= 1.0:
            raise ProtocolError("bad_factor", f"a factor must lie in [0, 1], got {f}")
        if self._exchanges.confirm(header["xid"], header["from"], f):
            return Reply(encode_header("ack", header.id))
        return Reply(encode_header("error", header.id, reason="unknown_exchange",
                                   detail="no such exchange is waiting (expired, or not from you)"))

    # ----------------------------------------------------------------- lifecycle

    def stats(self) -> dict[str, Any]:
        """Counters (fetches ok, timed out, rejected; bytes in and out; ...) and per-peer scores."""
        out = self.counters.snapshot()
        for key in ("fetches_started", "fetches_ok", "fetches_timed_out", "fetches_rejected",
                    "fetches_refused", "fetches_failed", "averaged", "bytes_in", "bytes_out",
                    "requests_served", "requests_rejected", "same_host_fetches"):
            out.setdefault(key, 0)
        out.setdefault("last_fetch_latency_s", None)
        scores = self._selector.scores()
        out["peers"] = {
            peer: {"score": scores[peer], "failures": out.pop(f"peer.{peer}.failures", 0)} for peer in self.peers
        }
        out["clock"] = self._clock
        out["snapshot_slots"] = self._store.slots
        out["publish_skipped"] = self._store.skipped
        out["exchanges_pending"] = len(self._exchanges)
        out["exchanges_expired"] = self._exchanges.expired
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"dpwa node {self.name!r} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop both threads, close every socket with linger 0 and free the port. Idempotent.

        A fetch in flight is abandoned; the model is left as it is. Takes at
        most about `timeout_s` per thread, and logs an error if a thread is
        still alive after that. Shared-memory slot files are deleted.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._job is not None:
            self._job.abandon()
            self._job = None
        stopped = True
        if self._tx is not None:
            stopped &= self._tx.close(timeout_s)
        if self._server is not None:
            stopped &= self._server.close(timeout_s)
        if self._ctx is not None:
            if stopped:
                self._ctx.term()  # every socket is closed, so this returns at once
            else:
                logger.error("%s: leaving the ZeroMQ context open because a thread did not stop", self.name)
        if self._own is not None:
            self._own.release()
        with self._committed_lock:
            committed, self._committed = self._committed, []
        for item in committed:
            item.release()
        self._exchanges.close()
        for reader in self._readers.values():
            reader.close()
        if self._shared is not None:
            self._shared.close()
        logger.info("%s: closed", self.name)

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
