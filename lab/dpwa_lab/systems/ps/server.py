"""A parameter server: one shard of the model, served over dpwa's transport, one queue and one applier per block.

The server's thread (the transport's) owns the ROUTER socket. A pull copies
every block under its lock into a fresh buffer and sends it without another
copy. A push is checked whole before any block sees it (the plan's
fingerprint, this server's index, one version per block and none ahead of
the block's, the frame's exact size, finite values within bounds, room in
every block's queue), then each block's slice of the frame is queued for its
applier; the trainer does not wait for the update to be applied.

Example::

    plan = make_plan(layout, servers=2)
    with ParameterServer(plan, 0, initial_values, "ipc:///tmp/ps0", settings=SGDSettings(lr=0.05)) as server:
        ...
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import zmq

from dpwa.wire.curve import CurveKeys
from dpwa.wire.errors import ProtocolError, Refused
from dpwa.wire.schema import encode
from dpwa.wire.server import Reply, Request, Route, Server

from ..layout import check_values
from ..optim import SGDSettings
from . import protocol as m
from .blocks import BlockApplier, BlockUpdate
from .sharding import ShardPlan

__all__ = ["ParameterServer"]


class ParameterServer:
    """Serves shard `index` of `plan`.

    Args:
        plan: the shard plan every trainer uses too.
        index: which of the plan's servers this is.
        values: the shard's initial values, in plan order (copied).
        endpoint: where to bind.
        settings: the optimizer of the parameter blocks.
        schedule: learning rate as a function of the samples a block has applied.
        scale: every update is multiplied by this (1/N for N trainers: see :mod:`.blocks`).
        queue_depth: updates that may wait per block before pushes are refused ``busy``.
        context: the ZeroMQ context (default: a private one, terminated by close()).
        curve: serve only the clients whose CURVE keys it lists.
        trainers: without CURVE, the names a request's ``from`` may give (None: any).
    """

    def __init__(
        self,
        plan: ShardPlan,
        index: int,
        values: np.ndarray,
        endpoint: str,
        *,
        settings: SGDSettings,
        schedule: Callable[[int], float] | None = None,
        scale: float = 1.0,
        queue_depth: int = 8,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        trainers: Collection[str] | None = None,
        name: str | None = None,
    ) -> None:
        if not 0 <= index < plan.count:
            raise ValueError(f"server index must be in 0..{plan.count - 1}, got {index}")
        self.plan = plan
        self.index = index
        self.name = name or f"ps{index}"
        size = plan.size(index)
        if values.shape != (size,):
            raise ValueError(f"{self.name}: expected {size} initial values, got shape {values.shape}")
        check_values(np.asarray(values, np.float32), f"{self.name}'s initial values")
        self.values = np.array(values, dtype=np.float32)
        self.blocks = [
            BlockApplier(
                b,
                self.values[b.offset : b.offset + b.size],
                settings,
                schedule,
                scale=scale,
                queue_depth=queue_depth,
                name=self.name,
            )
            for b in plan.servers[index]
        ]
        self.pushes = 0
        self.refused: Counter[str] = Counter()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        routes = {
            m.PULL.name: Route(m.PULL, self._pull, bulk=True),
            m.PUSH.name: Route(m.PUSH, self._push, max_payload_bytes=4 * size),
            m.STATUS.name: Route(m.STATUS, self._status),
        }
        clients = len(trainers) if trainers is not None else 8
        self.server = Server(
            self._ctx,
            endpoint,
            routes,
            name=self.name,
            curve=curve,
            senders=trainers,
            max_unsent_per_client=4,
            max_unsent=max(8, 4 * clients),
        )
        self.endpoint = endpoint

    # ----------------------------------------------------------------- lifetime

    def start(self, timeout_s: float = 10.0) -> ParameterServer:
        for block in self.blocks:
            block.start()
        try:
            self.server.start(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop serving, then stop every applier (queued updates are dropped). True if every thread ended."""
        ended = self.server.close(timeout_s)
        for block in self.blocks:
            ended = block.close(timeout_s) and ended
        if self._own_context and ended:
            self._ctx.term()
        return ended

    def __enter__(self) -> ParameterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- reading

    def snapshot(self) -> tuple[np.ndarray, list[int], int]:
        """A consistent copy of each block (values, versions, the fewest samples any block applied)."""
        out = np.empty_like(self.values)
        versions, samples = [], []
        for block in self.blocks:
            b = block.block
            version, applied = block.read(out[b.offset : b.offset + b.size])
            versions.append(version)
            samples.append(applied)
        return out, versions, min(samples, default=0)

    def status(self) -> dict[str, Any]:
        staleness: Counter[int] = Counter()
        for block in self.blocks:
            staleness.update(block.staleness_counts())
        applied = sum(staleness.values())
        _, versions, samples = self.snapshot()
        return {
            "server": self.index,
            "blocks": len(self.blocks),
            "elements": int(self.values.size),
            "pushes": self.pushes,
            "applied": applied,
            "samples": samples,
            "versions": versions,
            "staleness": [[k, n] for k, n in sorted(staleness.items())],
            "staleness_mean": sum(k * n for k, n in staleness.items()) / applied if applied else 0.0,
            "staleness_max": max(staleness, default=0),
            "queued": sum(block.queued for block in self.blocks),
            "refused": dict(self.refused),
        }

    # ----------------------------------------------------------------- handlers (the server's thread)

    def _check(self, request: Request) -> None:
        h = request.header
        if h["fp"] != self.plan.fingerprint:
            raise ProtocolError("bad_fingerprint", "the request was made for another shard plan or model")
        if h["server"] != self.index:
            raise ProtocolError("bad_server", f"a request for server {h['server']} reached server {self.index}")

    def _pull(self, request: Request) -> Reply:
        self._check(request)
        out, versions, samples = self.snapshot()
        header = encode(
            m.PARAMS, request.header.id, server=self.index, versions=versions, samples=samples, nbytes=out.nbytes
        )
        return Reply(header, payload=[out])

    def _refuse(self, reason: str, detail: str, bad: bool = True) -> Exception:
        self.refused[reason] += 1
        return ProtocolError(reason, detail) if bad else Refused(reason, detail)

    def _push(self, request: Request) -> Reply:
        self._check(request)
        h = request.header
        versions: list[int] = h["versions"]
        if len(versions) != len(self.blocks):
            raise self._refuse("bad_blocks", f"{len(versions)} versions for the {len(self.blocks)} blocks held here")
        for block, version in zip(self.blocks, versions, strict=True):
            if version > block.version:
                raise self._refuse(
                    "bad_version",
                    f"block {block.block.variable.name}: version {version} is ahead of the server's {block.version}",
                )
        (frame,) = request.payload
        if len(frame) != self.values.nbytes:
            raise self._refuse("bad_size", f"{len(frame)} bytes, this server holds {self.values.nbytes}")
        updates = np.frombuffer(frame.buffer, np.float32)
        try:
            check_values(updates, "the update")
        except ValueError as exc:
            raise self._refuse("bad_values", str(exc)) from None
        if not all(block.has_room() for block in self.blocks):
            raise self._refuse("busy", "a block's queue is full", bad=False)
        now = time.monotonic()
        for block, version in zip(self.blocks, versions, strict=True):
            b = block.block
            block.offer(BlockUpdate(updates[b.offset : b.offset + b.size], version, h["batch"], now))
        self.pushes += 1
        return Reply(encode(m.QUEUED, h.id, depth=max(block.queued for block in self.blocks)))

    def _status(self, request: Request) -> Reply:
        return Reply(encode(m.STATUS_REPLY, request.header.id, **self.status()))
