"""How a node starts: it takes the cluster's state from a peer, and, at a fresh start, waits for the others.

Before a node's constructor returns (``join: auto``):

* :func:`take_state` joins from a peer (see :mod:`dpwa.gossip.transfer.join` for whom,
  and what is checked): a late or restarted node takes a trained peer's
  parameters, optimizer state, clock and barrier counts; at a fresh start,
  every node but the first takes the first node's initial parameters;
* :func:`start_together`: at a fresh start of a node list, like DDP's
  constructor, it waits until every peer holds that same initial state (under
  torchrun the start barrier is torchrun's store: :mod:`dpwa.gossip.membership.rendezvous`).

With open membership (``bootstrap:``) :func:`find_members` comes first: it
asks the bootstrap addresses who the members are, announcing this node, and
the node then joins from them as a late node does (the node that answered
counts as "the first node" at a fresh start). There is no start barrier: the
cluster is whoever is there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ..backoff import Backoff
from ..config import Config, ConfigError
from ..logs import logger
from ..mixing.model import WireModel
from ..mixing.params import FlatParams
from ..stats import Counters
from ..wire.calls import Call
from ..wire.client import PeerBook
from .exchange.progress import Progress
from .membership.barrier import BarrierCounts, plausible
from .membership.flow import FlowControl
from .membership.members import Members, MembersTask
from .reporting import StatusTask
from .transfer.join import ExtraState, Joined, JoinTerms, join_cluster

__all__ = [
    "AtStart",
    "BOOTSTRAP_ROUNDS",
    "JOIN_WAIT_MIN_S",
    "find_members",
    "join_wait_s",
    "start_together",
    "take_state",
]

JOIN_WAIT_MIN_S = 10.0  # at a fresh start, how long a node waits at least for the first node's parameters
BOOTSTRAP_ROUNDS = 3  # times a starting node asks every bootstrap address before it starts alone


def join_wait_s(config: Config) -> float:
    """How long a starting node waits for its peers: max(JOIN_WAIT_MIN_S, 4 timeouts)."""
    return max(JOIN_WAIT_MIN_S, 4 * config.timeout_s)


def take_state(
    name: str,
    config: Config,
    params: FlatParams,
    model: WireModel,
    extra: ExtraState | None,
    submit: Callable[[Any], Call],
    flow: FlowControl,
    progress: Progress,
    barriers: BarrierCounts,
    counters: Counters,
    *,
    trained_only: bool = False,
    wait_s: float | None = None,
    order: list[str] | None = None,
) -> tuple[Joined | None, bool]:
    """Take the cluster's state from a peer, into `params` (and `extra`, `progress`, `barriers`).

    `order`: the nodes, the first one's state taken at a fresh start (None: the config's node list).
    Returns (what was taken or None, whether the cluster has trained already: a peer's clock is above 0).
    """
    terms = JoinTerms(
        model,
        extra_budget=extra.budget() if extra is not None else 0,
        check_extra=extra.check if extra is not None else None,
    )
    joined, trained = join_cluster(
        name,
        order if order is not None else [spec.name for spec in config.nodes],
        submit,
        flow.selector.ranked,
        config.timeout_s,
        wait_s if wait_s is not None else join_wait_s(config),
        terms,
        lambda message: logger.warning("%s: %s", name, message),
        trained_only=trained_only,
    )
    if joined is None:
        return None, trained
    params.lerp_from(joined.params, 1.0, model.kept)  # f = 1 takes the donor's snapshot exactly
    if extra is not None and joined.extra_state is not None:
        extra.load(joined.extra_state)  # checked on arrival, field by field (ExtraState.check)
    if trained:  # a late or restarted node: it continues where the cluster is
        progress.set_clock(joined.clock)
        # where the cluster is, or where we were if the donor knew us further on: never beyond what the peers say
        for counts, what in ((joined.barriers, "its barrier counts"), (joined.yours, "our barrier counts")):
            adopted, cut = plausible(counts, joined.reports)
            if cut:
                logger.warning(
                    "%s: %s gave %s beyond what the other peers report (%s); took %s",
                    name,
                    joined.donor,
                    what,
                    ", ".join(f"{n}={counts[n]}" for n in cut),
                    ", ".join(f"{n}={adopted[n]}" for n in cut),
                )
            barriers.restore(adopted)
    counters.add("joined")
    logger.info(
        "%s: took %s's state (clock %.0f, barriers %s, %s, digest %s)",
        name,
        joined.donor,
        joined.clock,
        barriers.own() if trained else "not taken at a fresh start",
        "with its optimizer state" if joined.extra_state is not None else "parameters only",
        joined.digest.hex(),
    )
    return joined, trained


class AtStart:
    """The peers that told us they wait at their start barrier (their status requests say ``at_start``):
    written by the Rx thread (StatusServer), read by :func:`start_together` on the training thread.

    Such a peer has joined, so it counts as started even if it has trained and gone again by the time we
    ask it: a short script's peer can be done within the pause between two of our polls."""

    def __init__(self, peers: list[str]) -> None:
        self._peers = frozenset(peers)
        self._lock = threading.Lock()
        self._heard: set[str] = set()

    def heard(self, sender: str) -> None:
        if sender in self._peers:  # the config's names only: anything else a client claims is ignored
            with self._lock:
                self._heard.add(sender)

    def names(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._heard)


def start_together(
    name: str,
    peers: list[str],
    submit: Callable[[Any], Call],
    timeout_s: float,
    wait_s: float,
    at_start: AtStart | None = None,
) -> None:
    """A fresh start of a node list: wait until every peer has joined (taken the first node's state),
    or has trained already, or `wait_s` passed (then say who is missing and go on: it joins later).

    A peer has joined when its status says so, or when it asked for ours from its own start barrier
    (`at_start`); our requests say we wait at ours."""
    deadline = time.monotonic() + wait_s
    waiting = set(peers)
    backoff = Backoff(0.01, 0.2)  # between polls: 10 ms, doubling up to 0.2 s
    while waiting:
        end = time.monotonic() + timeout_s
        calls = {peer: submit(StatusTask(peer, end, name, at_start=True)) for peer in waiting}
        for peer, call in calls.items():
            call.wait(timeout_s + 0.2)
            if not call.done.is_set() or call.outcome != "ok":
                call.abandon()
                continue
            report = call.take()
            if report["state"] not in ("starting", "joining") or report["clock"] > 0:
                waiting.discard(peer)
        # after asking: every peer asked once hears that we wait, so it need not find us here in turn
        waiting -= at_start.names() if at_start is not None else frozenset()
        if not waiting:
            return
        if time.monotonic() + backoff.peek() >= deadline:
            logger.warning(
                "%s: %s did not start within %.0f s; training without waiting for them (they join later)",
                name,
                ", ".join(sorted(waiting)),
                wait_s,
            )
            return
        time.sleep(backoff.next())  # a bounded poll while the others join


def find_members(
    name: str, config: Config, members: Members, book: PeerBook, submit: Callable[[Any], Call]
) -> str | None:
    """Ask the bootstrap addresses in order, at most BOOTSTRAP_ROUNDS times each (``timeout_ms`` each ask),
    until one answers and admits this node; merge its view. Returns the name of the node that answered, or
    None when none did (then this node starts alone, or raises ConnectionError with ``bootstrap_alone:
    false``). A member that holds this node's name elsewhere but never answered there (a squatter's entry, or
    this node's own from before a restart) gives the name back when this node announces itself; one that
    answers keeps it, and this raises ConfigError once the rounds are done."""
    addresses = config.bootstrap_for(name)
    backoff = Backoff(0.1, 1.0)  # between rounds: 0.1 s, doubling up to 1 s
    taken_by = None  # a member holding our name elsewhere, as the last answer told
    try:
        for round_ in range(BOOTSTRAP_ROUNDS if addresses else 0):
            for spec in addresses:
                book.put(spec.name, config.endpoint(spec), members.options_for(spec.public_key))
                call = submit(MembersTask(spec.name, time.monotonic() + config.timeout_s, members.own_entry()))
                call.wait(config.timeout_s + 0.2)
                if not call.done.is_set() or call.outcome != "ok":
                    call.abandon()
                    logger.info("%s: bootstrap %s:%d did not answer (%s)", name, spec.host, spec.port, call.outcome)
                    continue
                digest, admitted = call.take()
                answerer = digest[0]["name"] if digest else ""
                taken = [
                    e for e in digest if e.get("name") == name and e.get("endpoint") != members.own_entry()["endpoint"]
                ]
                taken_by = (spec, taken[0]["endpoint"]) if taken and not admitted else None
                members.merge(answerer, [e for e in digest if e.get("name") != name])
                if admitted and answerer in members:
                    logger.info(
                        "%s: joined the cluster through %s (%s:%d): members %s",
                        name, answerer, spec.host, spec.port, ", ".join(members.names()),
                    )  # fmt: skip
                    return str(answerer)
                logger.info(
                    "%s: %s:%d answered but did not admit us yet (rate limit); asking again", name, spec.host, spec.port
                )
            if round_ + 1 < BOOTSTRAP_ROUNDS:
                time.sleep(backoff.next())  # a bounded pause between rounds while the cluster starts
    finally:
        for spec in addresses:
            book.drop(spec.name)
    if taken_by is not None:
        raise ConfigError(
            f"{config.source}: the cluster at {taken_by[0].host}:{taken_by[0].port} has a member named {name!r} at "
            f"{taken_by[1]} that answers there; names must be unique"
        )
    if addresses and not config.bootstrap_alone:
        raise ConnectionError(
            f"{name}: no bootstrap address answered in {BOOTSTRAP_ROUNDS} rounds "
            f"({', '.join(config.bootstrap)}), and bootstrap_alone is false"
        )
    others = [n for n in members.names() if n != name]
    if others:
        logger.warning(
            "%s: no bootstrap address answered; starting with the config's nodes %s", name, ", ".join(others)
        )
    else:
        logger.warning(
            "%s: no bootstrap address answered%s; starting alone, as the first node of the cluster others join",
            name,
            "" if addresses else " (they are all this node)",
        )
    return None
