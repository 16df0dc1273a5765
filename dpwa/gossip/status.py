"""A node's status over its own socket: the ``status`` request kind, read-only.

``python -m dpwa status CONFIG`` sends one ``status`` request to every node
of a config and prints their answers as one table (see :mod:`dpwa.cluster.status`).
Under CURVE only listed keys get past the handshake, so only holders of a
node's key may ask. The reply carries numbers only, every one bounded, and
fits its header limit: with more peers than fit, the worst-scored are kept.
``bytes_in``/``bytes_out`` count parameters moved through shared memory too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..wire.client import Ask
from ..wire.messages import (
    NAME_PATTERN,
    Choice,
    Integer,
    MapOf,
    Number,
    ProtocolError,
    Record,
    Text,
    encode,
    message_kind,
)
from ..wire.server import Reply, Request, Route
from .barrier import MAX_BARRIERS

__all__ = ["STATES", "STATUS", "STATUS_REPORT", "StatusServer", "StatusTask"]

STATES = ("starting", "joining", "training", "at_barrier", "lingering", "closing", "closed")
_NAME = Text(64, NAME_PATTERN)
_COUNT = Integer(0, 1 << 62)
_SECONDS = Number(0.0, 1e9, optional=True)
# averaged: how many times the node blended this peer's parameters (optional: older nodes do not say)
_PEER = Record({"score": Number(0.0, 1.0), "failures": _COUNT}, {"latency_s": _SECONDS, "averaged": _COUNT})
STATUS = message_kind("status", {"from": _NAME})
STATUS_REPORT = message_kind(
    "status_report",
    {
        "name": _NAME,
        "state": Choice(STATES),
        "epoch": _COUNT,
        "clock": Number(0.0, 1e15),
        "loss": Number(-1e30, 1e30, optional=True),
        "exchanges_per_s": Number(0.0, 1e9),
        "averaged": _COUNT,
        "failures": _COUNT,
        "bytes_in": _COUNT,
        "bytes_out": _COUNT,
        "served": _COUNT,
        "pending": _COUNT,
        "uptime_s": _SECONDS,
        "peers": MapOf(_NAME, _PEER, max_len=1024),
        "barriers": MapOf(Text(32, NAME_PATTERN), _COUNT, max_len=MAX_BARRIERS),
    },
    max_header_bytes=1 << 16,
)


class StatusServer:
    """Answers ``status`` requests from `report()`, a thread-safe read of the node's numbers."""

    def __init__(self, report: Callable[[], dict[str, Any]]) -> None:
        self._report = report

    def routes(self) -> dict[str, Route]:
        return {STATUS.name: Route(STATUS, self.serve)}

    def serve(self, request: Request) -> Reply:
        report = self._report()
        peers = report.get("peers", {})
        ranked = sorted(peers, key=lambda p: peers[p]["score"])[:1024]  # the worst peers first
        for key in ("exchanges_per_s", "clock"):
            if not math.isfinite(report[key]):
                report[key] = 0.0
        while True:  # the largest clusters: as many peers as fit the header limit
            report["peers"] = {name: peers[name] for name in ranked}
            try:
                return Reply(encode(STATUS_REPORT, request.header.id, **report))
            except ProtocolError as exc:
                if exc.reason != "header_too_large" or not ranked:
                    raise
                ranked = ranked[: len(ranked) * 3 // 4]


class StatusTask:
    """Ask one node for its status (value: the report's fields)."""

    def __init__(self, peer: str, deadline: float, name: str) -> None:
        self.peer, self.deadline, self._name = peer, deadline, name

    def run(self, ask: Ask) -> dict[str, Any]:
        response = ask(lambda rid: [encode(STATUS, rid, **{"from": self._name})], {STATUS_REPORT.name: STATUS_REPORT})
        return dict(response.header.fields)
