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
their names.

:class:`Counters` is pure bookkeeping; :class:`BarrierServer` answers the
requests (Rx thread); :class:`BarrierTask` asks one peer (Tx thread).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ..wire.client import Ask
from ..wire.messages import NAME_PATTERN, Integer, MapOf, Text, encode, message_kind
from ..wire.server import Reply, Request, Route

__all__ = ["BARRIER", "BARRIER_STATE", "BarrierServer", "BarrierTask", "BarrierTimeout", "Counters", "MAX_BARRIERS"]

MAX_BARRIERS = 16  # barrier names one node may use
_NAME = Text(32, NAME_PATTERN)
_COUNTS = MapOf(_NAME, Integer(0, 1 << 40), max_len=MAX_BARRIERS)
# requester -> server: "these are my counters"; answered with the server's, and what it knows of mine
BARRIER = message_kind("barrier", {"from": Text(64, NAME_PATTERN), "counters": _COUNTS})
BARRIER_STATE = message_kind("barrier_state", {"counters": _COUNTS, "yours": _COUNTS})


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


class Counters:
    """A node's barrier counters and what it heard of its peers'. Thread-safe."""

    def __init__(self, peers: list[str]) -> None:
        self._lock = threading.Lock()
        self._own: dict[str, int] = {}
        self._heard: dict[str, dict[str, int]] = {peer: {} for peer in peers}

    def own(self) -> dict[str, int]:
        with self._lock:
            return dict(self._own)

    def arrive(self, name: str) -> int:
        """Count one more call of barrier `name`; returns k (this is the k-th)."""
        with self._lock:
            if name not in self._own and len(self._own) >= MAX_BARRIERS:
                raise ValueError(f"at most {MAX_BARRIERS} barrier names per node, and {name!r} would be one more")
            self._own[name] = self._own.get(name, 0) + 1
            return self._own[name]

    def restore(self, counters: Mapping[str, int]) -> None:
        """Take counters from a checkpoint or from peers: a count never goes down."""
        with self._lock:
            for name, count in counters.items():
                self._own[name] = max(self._own.get(name, 0), int(count))

    def heard(self, peer: str, counters: Mapping[str, int]) -> None:
        with self._lock:
            known = self._heard.setdefault(peer, {})
            for name, count in counters.items():
                known[name] = max(known.get(name, 0), count)

    def of(self, peer: str) -> dict[str, int]:
        with self._lock:
            return dict(self._heard.get(peer, {}))

    def all_heard(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {peer: dict(counts) for peer, counts in self._heard.items()}

    def behind(self, name: str, k: int) -> list[str]:
        """Peers not known to have made their k-th call of `name`."""
        with self._lock:
            return [peer for peer, counts in self._heard.items() if counts.get(name, 0) < k]


class BarrierServer:
    """Answers ``barrier`` requests: records the asker's counters, tells it ours and what we know of its."""

    def __init__(self, counters: Counters, peers: list[str]) -> None:
        self._counters, self._peers = counters, set(peers)

    def routes(self) -> dict[str, Route]:
        return {BARRIER.name: Route(BARRIER, self.serve)}

    def serve(self, request: Request) -> Reply:
        sender = request.sender
        if sender in self._peers:
            self._counters.heard(sender, request.header["counters"])
        yours = self._counters.of(sender) if sender in self._peers else {}
        return Reply(encode(BARRIER_STATE, request.header.id, counters=self._counters.own(), yours=yours))


class BarrierTask:
    """Tell one peer our counters and hear its own (and what it knows of ours). Value: (its, ours as it knows)."""

    def __init__(self, peer: str, deadline: float, name: str, counters: dict[str, int]) -> None:
        self.peer, self.deadline, self._name, self._counters = peer, deadline, name, counters

    def run(self, ask: Ask) -> tuple[dict[str, int], dict[str, int]]:
        fields: dict[str, Any] = {"from": self._name, "counters": self._counters}
        response = ask(lambda rid: [encode(BARRIER, rid, **fields)], {BARRIER_STATE.name: BARRIER_STATE})
        return dict(response.header["counters"]), dict(response.header["yours"])
