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

**What an arrival can claim.** Counts are integers in [0, :data:`MAX_COUNT`]
on the wire and in memory; a node refuses a call that would count past it.
What a peer says of its counts is believed only up to one call past this
node's own count plus :data:`SLACK`: a barrier compares a peer's count with
this node's own call number, so nothing true is lost, and a forged or buggy
``2**40`` moves the peer's recorded count by two calls at most, not for ever.
A request from a name that is not a peer of the config counts for nothing.
Counts a joining node takes from its donor are bounded by what the cluster
reports (:func:`plausible`).

:class:`BarrierCounts` is pure bookkeeping; :class:`BarrierServer` answers the
requests (Rx thread); :class:`BarrierTask` asks one peer (Tx thread).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..logs import logger
from ..wire.calls import Ask, Call
from ..wire.schema import NAME_PATTERN, Integer, MapOf, Text, encode, message_kind
from ..wire.server import Reply, Request, Route

__all__ = [
    "BARRIER",
    "BARRIER_STATE",
    "COUNTS",
    "MAX_BARRIERS",
    "MAX_COUNT",
    "SLACK",
    "BarrierCounts",
    "BarrierServer",
    "BarrierTask",
    "BarrierTimeout",
    "BarrierWaiter",
    "plausible",
]

MAX_BARRIERS = 16  # barrier names one node may use
MAX_COUNT = 2**31 - 1  # calls of one barrier name, at most: the wire's bound, and memory's
SLACK = 1  # a peer's count is believed up to this many calls beyond one past our own
_NAME = Text(32, NAME_PATTERN)
COUNTS = MapOf(_NAME, Integer(0, MAX_COUNT), max_len=MAX_BARRIERS)  # name -> calls made
# requester -> server: "these are my counters"; answered with the server's, and what it knows of mine
BARRIER = message_kind("barrier", {"from": Text(64, NAME_PATTERN), "counters": COUNTS})
BARRIER_STATE = message_kind("barrier_state", {"counters": COUNTS, "yours": COUNTS})


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


class BarrierCounts:
    """A node's barrier counts (name -> calls made) and what it heard of its peers'. Thread-safe.

    Every count stays within [0, MAX_COUNT]; a peer's is capped at one call past
    ours plus SLACK (see the module docstring).
    """

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
            count = self._own.get(name, 0)
            if count >= MAX_COUNT:
                raise ValueError(f"barrier {name!r} has been called {count} times, the most a count can hold")
            self._own[name] = count + 1
            return count + 1

    def restore(self, counts: Mapping[str, int]) -> None:
        """Take counts from a checkpoint or from peers: a count never goes down.

        Raises ValueError, and takes nothing, if a name or a count is not one a barrier can have.
        """
        checked = _checked(counts)
        with self._lock:
            names = set(self._own) | set(checked)
            if len(names) > MAX_BARRIERS:
                raise ValueError(f"{len(names)} barrier names, at most {MAX_BARRIERS}")
            for name, count in checked.items():
                self._own[name] = max(self._own.get(name, 0), count)

    def heard(self, peer: str, counts: Mapping[str, int]) -> None:
        """Record what `peer` said of its counts (already checked against the wire schema), capped."""
        with self._lock:
            known = self._heard.get(peer)
            if known is None:
                return  # not a peer of ours: counts for nothing
            for name, count in counts.items():
                if name not in known and len(known) >= MAX_BARRIERS:
                    continue
                believed = min(int(count), self._own.get(name, 0) + 1 + SLACK, MAX_COUNT)
                known[name] = max(known.get(name, 0), believed)

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


def _checked(counts: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(counts, Mapping):
        raise ValueError(f"barrier counts must be a mapping of name -> count, got {type(counts).__name__}")
    try:
        return COUNTS.check(dict(counts))
    except ValueError as exc:
        raise ValueError(f"barrier counts {dict(counts)!r:.200}: {exc}") from None


def plausible(counts: Mapping[str, int], reports: Iterable[Mapping[str, int]]) -> tuple[dict[str, int], list[str]]:
    """`counts` a donor offers, bounded by what the cluster reports: (the counts to adopt, names cut).

    For each name the bound is the median of the `reports` (every answering peer's own counts,
    the donor's included) plus SLACK: one peer alone cannot move a joiner far past the others.
    """
    reports = list(reports)
    adopted: dict[str, int] = {}
    cut: list[str] = []
    for name, count in counts.items():
        bound = int(statistics.median_low([r.get(name, 0) for r in reports] or [0])) + SLACK
        adopted[name] = min(count, bound, MAX_COUNT)
        if count > adopted[name]:
            cut.append(name)
    return adopted, cut


class BarrierServer:
    """Answers ``barrier`` requests: records the asker's counters, tells it ours and what we know of its."""

    def __init__(self, counters: BarrierCounts, peers: list[str]) -> None:
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


BARRIER_POLL_MAX_S = 1.0  # a peer not yet at a barrier is asked again at most this long after the last time


class BarrierWaiter:
    """Waits at barriers on the training thread: asks peers (on the Tx thread) until every one has arrived.

    Owns the requests it leaves behind: after a barrier, a peer that has not heard of our arrival is told,
    and nobody waits for that answer; those calls are dropped as they finish (:meth:`tidy`).

    Args:
        name: this node.
        peers: every other node of the cluster.
        counts: our barrier counts and what we heard of our peers'.
        submit: runs a task on the Tx thread.
        timeout_s: the deadline of one request.
    """

    def __init__(
        self, name: str, peers: list[str], counts: BarrierCounts, submit: Callable[[Any], Call], timeout_s: float
    ) -> None:
        self._name, self._peers, self._counts, self._submit, self._timeout_s = name, peers, counts, submit, timeout_s
        self._stray: list[Call] = []  # calls whose result nobody needs (a barrier's last word to a peer)

    def tidy(self) -> None:
        """Drop the finished calls nobody waits for."""
        self._stray = [call for call in self._stray if not call.done.is_set()]

    def wait(
        self,
        name: str,
        k: int,
        deadline: float,
        missing: str,
        stop: Callable[[], bool],
        idle: Callable[[], None],
    ) -> list[str]:
        """Wait until every peer has made its k-th call of `name` (see Node.barrier); `idle` keeps exchanging."""
        calls: dict[str, Call] = {}
        told: set[str] = set()  # peers that have heard of this arrival
        next_try = dict.fromkeys(self._peers, 0.0)
        pause = dict.fromkeys(self._peers, 0.01)
        while True:
            for peer, call in list(calls.items()):
                if not call.done.is_set():
                    continue
                del calls[peer]
                if call.outcome == "ok":
                    theirs, _ = call.take()
                    self._counts.heard(peer, theirs)
                    told.add(peer)
                pause[peer] = min(BARRIER_POLL_MAX_S, 2 * pause[peer])
                next_try[peer] = time.monotonic() + pause[peer]
            behind = self._counts.behind(name, k)
            now = time.monotonic()
            if not behind:
                self._tell([p for p in self._peers if p not in told], calls)
                return []
            stopped = stop()
            if now >= deadline or stopped:
                heard = self._counts.all_heard()
                for call in calls.values():
                    call.abandon()
                if stopped:
                    logger.info(
                        "%s: stopped at barrier %r (call %d) before %s arrived", self._name, name, k, ", ".join(behind)
                    )
                    return behind
                if missing == "raise":
                    raise BarrierTimeout(name, k, behind, heard)
                logger.warning(
                    "%s: barrier %r (call %d): proceeding without %s", self._name, name, k, ", ".join(behind)
                )
                return behind
            for peer in self._peers:
                if (peer in behind or peer not in told) and peer not in calls and now >= next_try[peer]:
                    end = min(deadline, now + self._timeout_s)
                    calls[peer] = self._submit(BarrierTask(peer, end, self._name, self._counts.own()))
            idle()
            wake = min([next_try[p] for p in self._peers if p not in calls] + [now + 0.02])
            time.sleep(max(0.001, min(0.02, wake - now)))  # a bounded poll: the Tx thread asks meanwhile

    def _tell(self, peers: list[str], calls: dict[str, Call]) -> None:
        """Best effort: let peers that have not heard of our arrival hear of it (nobody waits for the answers)."""
        self._stray.extend(calls.values())
        for peer in peers:
            if peer not in calls:
                task = BarrierTask(peer, time.monotonic() + self._timeout_s, self._name, self._counts.own())
                self._stray.append(self._submit(task))

    def close(self) -> None:
        for call in self._stray:
            call.abandon()
        self._stray.clear()
