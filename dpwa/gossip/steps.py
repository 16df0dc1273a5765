"""One training step's exchange: what update_wait returns, and the interface both mixing modes implement.

A node picks its mode once, in its constructor: :class:`~dpwa.gossip.pull.PullSteps`
(only the requester moves) or :class:`~dpwa.gossip.symmetric.SymmetricSteps`
(both sides move). Either is a :class:`Steps`: it starts a request at
``update_send``, finishes it at ``update_wait``, applies what settled in the
background (``tend``), keeps exchanging while the node makes no steps
(``idle``) and settles what is pending before the node closes (``settle``).
What both need from the node is a :class:`Crew`: the parts and the state
they share, each owned by the training thread or thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..config import Config
from ..mixing.model import WireModel
from ..mixing.params import FlatParams
from ..mixing.rules import Rule
from ..stats import Counters
from ..wire.calls import Call
from ..wire.server import Route
from .flow import FlowControl
from .guard import RuleGuard
from .outcomes import Outcomes
from .parts import Parts
from .progress import Progress
from .snapshots import Lease

__all__ = ["WAIT_SLACK_S", "Crew", "OuterHook", "Step", "StepOutcome", "Steps", "Update"]

WAIT_SLACK_S = 0.2  # update_wait returns at most this long after a request's deadline

# What an update_wait did: a call's outcome (dpwa.wire.calls.Outcome), or no request, or an exchange in doubt
StepOutcome = Literal[
    "ok", "no_fetch", "timeout", "refused", "rejected", "failed", "expired", "cancelled", "in_doubt", "rule_broken"
]


@dataclass(frozen=True)
class Update:
    """What one update_wait did, for logging."""

    averaged: bool  # True if a peer's parameters were blended in
    outcome: StepOutcome
    peer: str | None = None  # the peer asked, if any
    factor: float | None = None  # f in params = f * peer + (1 - f) * params, when averaged
    reason: str = ""  # why not averaged, in words
    latency_s: float | None = None  # request time, when a request finished
    clock: float = 0.0  # this node's clock after the update


@dataclass(eq=False)
class Step:
    """The training thread's current step, from update_send to update_wait."""

    batch: float
    send_loss: float | None
    call: Call | None = None
    deadline: float = 0.0
    own: Lease | None = None  # pull/delta: our snapshot of this step, which the delta is taken from


class OuterHook(Protocol):
    """An outer step, taken after each blend of an exchange the node started (training thread): the
    named one (:class:`~dpwa.gossip.outer.OuterStep`, ``outer:``), or one given to the node (the
    PyTorch adapter's ``outer_optimizer``)."""

    def apply(self) -> None:
        """After a blend: one outer step; the parameters continue from its result."""

    def reanchor(self) -> None:
        """The parameters were replaced (a join, a restore): start afresh from them."""


@dataclass
class Crew:
    """What a mode's steps work with: the node's parts and the state they share (training thread)."""

    name: str
    config: Config
    params: FlatParams
    model: WireModel
    parts: Parts
    flow: FlowControl
    progress: Progress
    counters: Counters
    outcomes: Outcomes
    rule: Rule  # how f is chosen and each half applied (dpwa.mixing.rules)
    guard: RuleGuard  # applies each half of the rule, checked (dpwa.gossip.guard)
    publish: Callable[[float | None], None]  # publish a snapshot with this loss (and the clock as it is)
    state: Callable[[], str] = field(default=lambda: "training")
    outer: OuterHook | None = None  # outer: nesterov or noloco, or one given to the node

    def blended(self) -> None:
        """After each blend of an exchange this node started: the outer step, if it takes one. (A half
        mirrored for a peer takes none: its change is part of the next pseudo-gradient.)"""
        if self.outer is not None:
            self.outer.apply()


class Steps(Protocol):
    """A mixing mode, chosen once per node."""

    wakeup: threading.Event  # set when something settles in the background (a lingering node waits on it)

    def routes(self) -> dict[str, Route]:
        """The request kinds this mode serves besides fetches (symmetric: exchanges and their confirms)."""

    def start(self, step: Step) -> bool:
        """update_send: publish a snapshot, and maybe start a request. True if one started."""

    def finish(self, step: Step, own_loss: float | None) -> Update:
        """update_wait: wait for the request (within its deadline) and blend what came, in place."""

    def abandon(self, step: Step) -> None:
        """The step will not be finished (update_wait was skipped): let go of its request."""

    def tend(self) -> int:
        """Apply what settled in the background since the last call; returns how many blends."""

    def idle(self) -> None:
        """While the node makes no steps (lingering, at a barrier): keep taking part."""

    def settle(self, deadline: float) -> None:
        """close(), before the Rx thread stops: settle what is pending, by `deadline`."""

    def close(self) -> None:
        """close(), after the Rx thread stopped: let go of what is still held."""

    def report(self) -> dict[str, Any]:
        """Numbers for stats() and status: pending exchanges and the like."""

    def forget(self, peer: str) -> None:
        """`peer` left the view, or came back as a new node (a restart): what was held against it goes."""
