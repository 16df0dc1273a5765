"""An asynchronous trainer: fetch the latest parameters before the forward pass, send gradients from an IO pool.

Each step::

    trainer.fetch()          # pull every server's blocks (in parallel, on the IO pool) into the model
    loss = forward_backward(trainer.view.module, batch)
    trainer.push(batch_size) # split gradients (and buffer deltas) by the plan; one push per server, sent
                             # by the IO pool while the next step computes

No step waits for another trainer. A push is not waited for unless
``max_in_flight`` pushes to that server are still unanswered.

**A server that does not answer** (dead, or unreachable) is marked down after
two failures in a row: its blocks keep the values last fetched, pushes to it
are dropped (and counted), and it is tried again after 1 s, then 2 s, up to
every 10 s; the first answer brings it back. Training goes on with the other
shards. A refused push (``busy``: the server's queues are full) is dropped
and counted; it does not count against the server.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zmq

from dpwa.backoff import Backoff
from dpwa.wire.calls import Ask, Call
from dpwa.wire.errors import ProtocolError
from dpwa.wire.schema import encode

from ..layout import ModuleView, check_values
from . import protocol as m
from .iopool import IOPool
from .sharding import ShardPlan

__all__ = ["PSTrainer", "TrainerStats"]

DOWN_AFTER = 2  # failures in a row before a server is treated as down
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 10.0


@dataclass
class TrainerStats:
    pulls_ok: int = 0
    pulls_failed: int = 0
    pushes_ok: int = 0
    pushes_failed: int = 0  # no answer, or a transport failure
    pushes_refused: int = 0  # the server's queues were full
    pushes_dropped: int = 0  # not sent: the server was down
    bytes_sent: int = 0
    bytes_received: int = 0
    fetch_s: float = 0.0  # waiting for pulls
    push_wait_s: float = 0.0  # waiting for room to push
    servers_down: list[str] = field(default_factory=list)
    global_samples: int = 0  # samples the servers had applied at the last pull (the most any server had)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Health:
    """A server's failures in a row; from the DOWN_AFTER-th on, it is rested RETRY_FIRST_S, doubling to RETRY_MAX_S."""

    failures: int = 0
    rest: Backoff = field(default_factory=lambda: Backoff(RETRY_FIRST_S, RETRY_MAX_S))

    def usable(self, now: float) -> bool:
        return self.failures < DOWN_AFTER or self.rest.ready(now)

    def ok(self) -> None:
        self.failures = 0
        self.rest.reset()

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.failures >= DOWN_AFTER:
            self.rest.fail(now)


@dataclass
class _Pull:
    peer: str
    deadline: float
    fields: dict[str, Any]

    def run(self, ask: Ask) -> Any:
        return ask(lambda rid: [encode(m.PULL, rid, **self.fields)], {m.PARAMS.name: m.PARAMS})


@dataclass
class _Push:
    peer: str
    deadline: float
    fields: dict[str, Any]
    payload: np.ndarray  # owned by the task until it is sent

    def run(self, ask: Ask) -> Any:
        return ask(lambda rid: [encode(m.PUSH, rid, **self.fields), self.payload], {m.QUEUED.name: m.QUEUED})


class PSTrainer:
    """One trainer of the parameter-server system.

    Args:
        view: the trainer's model (its values are replaced at every fetch).
        plan: the shard plan the servers use.
        endpoints: server i's endpoint at position i.
        name: this trainer's name (the servers' ``from``).
        io_threads: the IO pool's size (default: 2 per server, at least 2).
        context: the ZeroMQ context (default: a private one, terminated by close()).
        socket_options: server index -> extra socket options (CURVE keys).
        timeout_s: deadline of one pull or push.
        max_in_flight: unanswered pushes per server before push() waits.
    """

    def __init__(
        self,
        view: ModuleView,
        plan: ShardPlan,
        endpoints: Sequence[str],
        name: str,
        *,
        io_threads: int | None = None,
        context: zmq.Context | None = None,
        socket_options: Mapping[int, Mapping[int, Any]] | None = None,
        timeout_s: float = 1.0,
        max_in_flight: int = 2,
    ) -> None:
        if len(endpoints) != plan.count:
            raise ValueError(f"the plan has {plan.count} servers, {len(endpoints)} endpoints were given")
        if max_in_flight < 1 or timeout_s <= 0:
            raise ValueError("max_in_flight must be at least 1 and timeout_s positive")
        self.view = view
        self.plan = plan
        self.name = name
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        layout = view.layout
        self._param_size = layout.param_size
        # Where each server's flat vector sits in our state vector (parameters, then buffers).
        self._index = [plan.state_index(k, layout.param_size) for k in range(plan.count)]
        covered = np.sort(np.concatenate(self._index))
        if not np.array_equal(covered, np.arange(layout.param_size + layout.buffer_size)):
            raise ValueError("the shard plan does not cover this model's layout exactly once")
        self._state = view.state()
        self._fetched_buffers = view.buffers()
        self._versions: list[list[int] | None] = [None] * plan.count
        self._health = [_Health() for _ in range(plan.count)]
        self._in_flight: list[deque[Call]] = [deque() for _ in range(plan.count)]
        self._names = [f"ps{i}" for i in range(plan.count)]
        self.stats = TrainerStats()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        options = {self._names[i]: dict(o) for i, o in (socket_options or {}).items()}
        largest = 4 * max(plan.size(i) for i in range(plan.count)) + (1 << 16)
        self.pool = IOPool(
            self._ctx,
            dict(zip(self._names, endpoints, strict=True)),
            threads=io_threads or max(2, 2 * plan.count),
            name=name,
            max_reply_bytes=largest,
            socket_options=options,
        ).start()

    # ----------------------------------------------------------------- lifetime

    def close(self, timeout_s: float = 5.0) -> bool:
        """Wait (up to `timeout_s`) for pushes in flight, then stop the IO pool and close its sockets."""
        deadline = time.monotonic() + timeout_s
        for server, calls in enumerate(self._in_flight):
            while calls:
                calls[0].wait(max(0.0, deadline - time.monotonic()))
                if not calls[0].done.is_set():
                    break
                self._settle_push(server, calls.popleft())
        ended = self.pool.close(timeout_s)
        if self._own_context and ended:
            self._ctx.term()
        return ended

    def __enter__(self) -> PSTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- fetch

    def fetch(self) -> int:
        """Pull every usable server's blocks into the model (before the forward pass). Returns servers fetched."""
        t0 = time.monotonic()
        calls: dict[int, Call] = {}
        for i in range(self.plan.count):
            if self._health[i].usable(t0):
                fields = {"from": self.name, "fp": self.plan.fingerprint, "server": i}
                calls[i] = self.pool.submit(_Pull(self._names[i], t0 + self.timeout_s, fields))
        fetched = 0
        samples = []
        for i, call in calls.items():
            call.wait(max(0.0, t0 + self.timeout_s + 0.2 - time.monotonic()))
            if not call.done.is_set():
                call.abandon()
            response = call.take() if call.outcome == "ok" else None
            try:
                got = self._load(i, response) if response is not None else None
            except ProtocolError:
                got = None
            if got is None:
                self.stats.pulls_failed += 1
                self._health[i].failed(time.monotonic())
                continue
            self._health[i].ok()
            self.stats.pulls_ok += 1
            samples.append(got)
            fetched += 1
        if fetched:
            self.view.load_state(self._state)
            self._fetched_buffers = self._state[self._param_size :].copy()
        if samples:
            self.stats.global_samples = max(samples)
        self.stats.servers_down = [self._names[i] for i, h in enumerate(self._health) if h.failures >= DOWN_AFTER]
        self.stats.fetch_s += time.monotonic() - t0
        return fetched

    def _load(self, server: int, response: Any) -> int:
        h = response.header
        index = self._index[server]
        (frame,) = response.frames
        if h["server"] != server or len(h["versions"]) != len(self.plan.servers[server]):
            raise ProtocolError("bad_reply", f"a reply for server {h['server']} with {len(h['versions'])} blocks")
        if len(frame) != 4 * index.size or h["nbytes"] != 4 * index.size:
            raise ProtocolError("bad_size", f"{len(frame)} bytes from server {server}, expected {4 * index.size}")
        values = np.frombuffer(frame.buffer, np.float32)
        try:
            check_values(values, f"server {server}'s parameters")
        except ValueError as exc:
            raise ProtocolError("bad_values", str(exc)) from None
        self._state[index] = values
        self._versions[server] = list(h["versions"])
        self.stats.bytes_received += len(frame)
        return int(h["samples"])

    # ----------------------------------------------------------------- push

    def push(self, batch: int) -> int:
        """Send this step's gradients and buffer deltas, one push per usable server. Returns pushes submitted."""
        update = np.concatenate([self.view.grads(), self.view.buffers() - self._fetched_buffers])
        now = time.monotonic()
        submitted = 0
        for i in range(self.plan.count):
            self._prune(i)
            versions = self._versions[i]
            if versions is None or not self._health[i].usable(now):
                self.stats.pushes_dropped += 1
                continue
            calls = self._in_flight[i]
            if len(calls) >= self.max_in_flight:
                t0 = time.monotonic()
                calls[0].wait(max(0.0, calls[0].task.deadline + 0.2 - t0))
                self.stats.push_wait_s += time.monotonic() - t0
                self._prune(i)
                if len(calls) >= self.max_in_flight:  # the oldest never ended: give up on it
                    calls[0].abandon()
                    self._settle_push(i, calls.popleft())
            payload = update[self._index[i]]  # a fresh array, owned by the task
            fields = {
                "from": self.name,
                "fp": self.plan.fingerprint,
                "server": i,
                "versions": versions,
                "batch": int(batch),
            }
            calls.append(self.pool.submit(_Push(self._names[i], time.monotonic() + self.timeout_s, fields, payload)))
            self.stats.bytes_sent += payload.nbytes
            submitted += 1
        return submitted

    def _prune(self, server: int) -> None:
        calls = self._in_flight[server]
        while calls and calls[0].done.is_set():
            self._settle_push(server, calls.popleft())

    def _settle_push(self, server: int, call: Call) -> None:
        if call.outcome == "ok":
            self.stats.pushes_ok += 1
            self._health[server].ok()
        elif call.outcome == "refused":
            self.stats.pushes_refused += 1
        else:
            self.stats.pushes_failed += 1
            self._health[server].failed(time.monotonic())
