"""How a node starts: it takes the cluster's state from a peer, and, at a fresh start, waits for the others.

Before a node's constructor returns (``join: auto``):

* :func:`take_state` joins from a peer (see :mod:`dpwa.gossip.join` for whom,
  and what is checked): a late or restarted node takes a trained peer's
  parameters, optimizer state, clock and barrier counts; at a fresh start,
  every node but the first takes the first node's initial parameters;
* :func:`start_together`: at a fresh start of a node list, like DDP's
  constructor, it waits until every peer holds that same initial state (under
  torchrun the start barrier is torchrun's store: :mod:`dpwa.gossip.rendezvous`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..logs import logger
from ..mixing.model import WireModel
from ..mixing.params import FlatParams
from ..stats import Counters
from ..wire.calls import Call
from .barrier import BarrierCounts, plausible
from .flow import FlowControl
from .join import ExtraState, Joined, JoinTerms, join_cluster
from .progress import Progress
from .reporting import StatusTask

__all__ = ["JOIN_WAIT_MIN_S", "join_wait_s", "start_together", "take_state"]

JOIN_WAIT_MIN_S = 10.0  # at a fresh start, how long a node waits at least for the first node's parameters


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
) -> tuple[Joined | None, bool]:
    """Take the cluster's state from a peer, into `params` (and `extra`, `progress`, `barriers`).

    Returns (what was taken or None, whether the cluster has trained already: a peer's clock is above 0).
    """
    terms = JoinTerms(
        model,
        extra_budget=extra.budget() if extra is not None else 0,
        check_extra=extra.check if extra is not None else None,
    )
    joined, trained = join_cluster(
        name,
        [spec.name for spec in config.nodes],
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


def start_together(name: str, peers: list[str], submit: Callable[[Any], Call], timeout_s: float, wait_s: float) -> None:
    """A fresh start of a node list: wait until every peer has joined (taken the first node's state),
    or has trained already, or `wait_s` passed (then say who is missing and go on: it joins later)."""
    deadline = time.monotonic() + wait_s
    waiting = set(peers)
    pause = 0.01
    while waiting:
        end = time.monotonic() + timeout_s
        calls = {peer: submit(StatusTask(peer, end, name)) for peer in waiting}
        for peer, call in calls.items():
            call.wait(timeout_s + 0.2)
            if not call.done.is_set() or call.outcome != "ok":
                call.abandon()
                continue
            report = call.take()
            if report["state"] not in ("starting", "joining") or report["clock"] > 0:
                waiting.discard(peer)
        if not waiting:
            return
        if time.monotonic() + pause >= deadline:
            logger.warning(
                "%s: %s did not start within %.0f s; training without waiting for them (they join later)",
                name,
                ", ".join(sorted(waiting)),
                wait_s,
            )
            return
        time.sleep(pause)  # a bounded poll while the others join
        pause = min(0.2, 2 * pause)
