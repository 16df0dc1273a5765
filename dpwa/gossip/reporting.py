"""What a node reports about itself: ``stats()``, and its status over its own socket (read-only).

:class:`Reporter` builds both from the same numbers (one table of each peer's
score, failures, latency and averages).

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

import time
from collections.abc import Callable
from typing import Any

import msgpack

from ..stats import Counters
from ..wire.calls import Ask
from ..wire.schema import NAME_PATTERN, Choice, Flag, Integer, MapOf, Number, Record, Text, clamp, encode, message_kind
from ..wire.server import Reply, Request, Route
from .exchange.progress import Progress
from .membership.barrier import MAX_BARRIERS, BarrierCounts
from .membership.flow import FlowControl
from .transfer.protocol import STATES, NodeState

__all__ = ["NodeState", "STATES", "STATUS", "STATUS_BYTES", "STATUS_REPORT", "Reporter", "StatusServer", "StatusTask"]

STATUS_BYTES = 1 << 16  # the largest status reply
MAX_PEERS_SHOWN = 1024  # peers one report lists at most (fewer if their names are long)

_NAME = Text(64, NAME_PATTERN)
_COUNT = Integer(0, 1 << 62)
_SECONDS = Number(0.0, 1e9, optional=True)
# averaged: how many times the node blended this peer's parameters (optional: older nodes do not say)
_PEER = Record({"score": Number(0.0, 1.0), "failures": _COUNT}, {"latency_s": _SECONDS, "averaged": _COUNT})
# at_start: the asker waits at its start barrier, so it holds the cluster's initial state (dpwa.gossip.start)
STATUS = message_kind("status", {"from": _NAME}, {"at_start": Flag()})
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
    """Answers ``status`` requests from `report()`, a thread-safe read of the node's numbers; tells
    `at_start(sender)` of every asker that says it waits at its start barrier."""

    def __init__(self, report: Callable[[], dict[str, Any]], at_start: Callable[[str], None] | None = None) -> None:
        self._report, self._at_start = report, at_start

    def routes(self) -> dict[str, Route]:
        return {STATUS.name: Route(STATUS, self.serve)}

    def serve(self, request: Request) -> Reply:
        if self._at_start is not None and request.header.get("at_start"):
            self._at_start(request.sender)
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

    def __init__(self, peer: str, deadline: float, name: str, at_start: bool = False) -> None:
        self.peer, self.deadline, self._name, self._at_start = peer, deadline, name, at_start

    def run(self, ask: Ask) -> dict[str, Any]:
        fields: dict[str, Any] = {"from": self._name, **({"at_start": True} if self._at_start else {})}
        response = ask(lambda rid: [encode(STATUS, rid, **fields)], {STATUS_REPORT.name: STATUS_REPORT})
        return dict(response.header.fields)


# stats() always has these counters, at 0 before they first move. `fetches_*` count the exchanges this node
# started, in either mode (mode pull: fetches; mode symmetric: exchange requests): public names, older than mode
# symmetric (docs/api.md says what each counts in each mode)
ALWAYS_COUNTED = (
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
)


class Reporter:
    """A node's numbers, for ``stats()`` (any thread) and for status requests (the Rx thread).

    Args:
        name: the node.
        counters, flow, progress, barriers: where the numbers are kept.
        state: reads the node's state.
        parts: reads the store's and bulk server's numbers (a callable: the parts exist once built).
        pending: reads the mode's numbers (pending exchanges).
    """

    def __init__(
        self,
        name: str,
        counters: Counters,
        flow: FlowControl,
        progress: Progress,
        barriers: BarrierCounts,
        state: Callable[[], NodeState],
        parts: Callable[[], dict[str, Any]],
        pending: Callable[[], dict[str, Any]],
    ) -> None:
        self._name, self._counters, self._flow = name, counters, flow
        self._progress, self._barriers, self._state, self._parts, self._pending = (
            progress,
            barriers,
            state,
            parts,
            pending,
        )

    def _peer_table(self, counts: dict[str, Any]) -> dict[str, dict[str, Any]]:
        scores = self._flow.selector.scores()
        return {
            peer: {
                "score": scores[peer],
                "failures": counts.get(f"peer.{peer}.failures", 0),
                "latency_s": counts.get(f"peer.{peer}.latency_s"),
                "averaged": counts.get(f"peer.{peer}.averaged", 0),
            }
            for peer in scores  # flow control's peers: the config's, or the view's members (open membership)
        }

    def stats(self) -> dict[str, Any]:
        """Counters (requests ok, timed out, rejected; bytes in and out; ...) and per-peer numbers."""
        counts = self._counters.snapshot()
        out = {key: value for key, value in counts.items() if not key.startswith("peer.")}
        for key in ALWAYS_COUNTED:
            out.setdefault(key, 0)
        out.setdefault("last_fetch_latency_s", None)
        out["peers"] = self._peer_table(counts)
        out["barriers"] = self._barriers.own()
        out["clock"] = self._progress.clock
        out["state"] = self._state()
        out["fetches_skipped_alone"] = self._flow.skipped_alone  # steps that started no exchange: backing off
        out["timeouts_slow"] = self._flow.slow  # timeouts of peers heard from meanwhile: slow, not rested
        out.update(self._parts())
        pending = self._pending()
        out.update({key: value for key, value in pending.items() if key != "pending"})
        return out

    def status(self) -> dict[str, Any]:
        """The numbers a ``status`` request gets (read from the Rx thread: each read is atomic)."""
        counts = self._counters.snapshot()
        now = time.monotonic()
        blends = counts.get("averaged", 0) + counts.get("mirrored", 0)
        progress = self._progress
        return {
            "name": self._name,
            "state": self._state(),
            "epoch": self._barriers.own().get("epoch", 0),
            "clock": progress.clock,
            "loss": progress.loss,
            "exchanges_per_s": progress.rate.per_second(now, blends),
            "averaged": blends,
            "failures": sum(counts.get(f"peer.{p}.failures", 0) for p in self._flow.selector.scores()),
            "bytes_in": counts.get("bytes_in", 0) + counts.get("shm_bytes_in", 0),  # sockets and shared memory
            "bytes_out": counts.get("bytes_out", 0) + counts.get("shm_bytes_out", 0),
            "served": counts.get("requests_served", 0),
            "pending": self._pending()["pending"],
            "uptime_s": now - progress.started,
            "peers": self._peer_table(counts),
            "barriers": self._barriers.own(),
        }
