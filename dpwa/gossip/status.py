"""A node's status over its own socket: the ``status`` request kind, read-only.

``python -m dpwa status CONFIG`` sends one ``status`` request to every node
of a config and prints their answers as one table (see :mod:`dpwa.cluster.status`).
Under CURVE only listed keys get past the handshake, so only holders of a
node's key may ask. The reply carries numbers only, every one bounded: a
node's own numbers are clamped into the schema before they are sent, so no
value it reports about itself (a loss of 1e40, say) can stop it answering.
The reply fits :data:`STATUS_BYTES`: the peers table is cut, the worst
scores kept first, and ``peers_omitted`` says how many were left out.
``bytes_in``/``bytes_out`` count parameters moved through shared memory too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from ..wire.calls import Ask
from ..wire.schema import NAME_PATTERN, Choice, Integer, MapOf, Number, Record, Text, clamp, encode, message_kind
from ..wire.server import Reply, Request, Route
from .barrier import MAX_BARRIERS

__all__ = ["STATES", "STATUS", "STATUS_BYTES", "STATUS_REPORT", "StatusServer", "StatusTask"]

STATUS_BYTES = 1 << 16  # the largest status reply
MAX_PEERS_SHOWN = 1024  # peers one report lists at most (fewer if their names are long)

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
        "peers": MapOf(_NAME, _PEER, max_len=MAX_PEERS_SHOWN),
        "barriers": MapOf(Text(32, NAME_PATTERN), _COUNT, max_len=MAX_BARRIERS),
    },
    {"peers_omitted": _COUNT},  # peers left out of `peers` to fit the reply
    max_header_bytes=STATUS_BYTES,
)


class StatusServer:
    """Answers ``status`` requests from `report()`, a thread-safe read of the node's numbers."""

    def __init__(self, report: Callable[[], dict[str, Any]]) -> None:
        self._report = report

    def routes(self) -> dict[str, Route]:
        return {STATUS.name: Route(STATUS, self.serve)}

    def serve(self, request: Request) -> Reply:
        return Reply(encode(STATUS_REPORT, request.header.id, **fit(self._report())))


def fit(report: dict[str, Any]) -> dict[str, Any]:
    """`report` made to fit STATUS_REPORT: numbers clamped, the peers table cut to the reply's size
    (worst scores first), with ``peers_omitted`` saying how many were left out."""
    specs = {**STATUS_REPORT.fields, **STATUS_REPORT.optional}
    out = {key: clamp(specs[key], value) if key in specs else value for key, value in report.items()}
    peers = out.pop("peers", {})
    room = STATUS_BYTES - len(msgpack.packb(out, use_bin_type=True)) - 256  # the envelope, the count, margin
    kept: dict[str, Any] = {}
    for name in sorted(peers, key=lambda p: (peers[p]["score"], p)):
        size = len(msgpack.packb({name: peers[name]}, use_bin_type=True))
        if len(kept) >= MAX_PEERS_SHOWN or size > room:
            break
        kept[name] = peers[name]
        room -= size
    out["peers"] = kept
    if len(kept) < len(peers):
        out["peers_omitted"] = len(peers) - len(kept)
    return out


class StatusTask:
    """Ask one node for its status (value: the report's fields)."""

    def __init__(self, peer: str, deadline: float, name: str) -> None:
        self.peer, self.deadline, self._name = peer, deadline, name

    def run(self, ask: Ask) -> dict[str, Any]:
        response = ask(lambda rid: [encode(STATUS, rid, **{"from": self._name})], {STATUS_REPORT.name: STATUS_REPORT})
        return dict(response.header.fields)
