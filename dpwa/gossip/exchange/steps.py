"""One training step's exchange: what update_wait returns, and the interface both mixing modes implement.

A node picks its mode once, in its constructor: :class:`~dpwa.gossip.exchange.pull.PullMode`
(only the requester moves) or :class:`~dpwa.gossip.exchange.symmetric.SymmetricMode`
(both sides move). Either is a :class:`Mode`: it starts a request at
``update_send``, finishes it at ``update_wait``, applies what settled in the
background (``apply_settled``), keeps exchanging while the node makes no steps
(``idle``) and settles what is pending before the node closes (``settle``).
What both need from the node is a :class:`ModeContext`: the services and the state
they share, each owned by the training thread or thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ...config import Config, NodeSpec
from ...mixing.codecs import Sender
from ...mixing.model import WireModel
from ...mixing.params import FlatParams
from ...mixing.rules import Rule
from ...stats import Counters
from ...wire.bulk import BulkServer
from ...wire.calls import Call
from ...wire.client import ClientThread, DirectClient
from ...wire.server import Route
from ...wire.shm import PeerSlots
from ..membership.flow import FlowControl
from ..transfer.paths import PeerPaths
from ..transfer.requesting import ReplyReader
from ..transfer.serving import Serving
from ..transfer.snapshots import Lease, SnapshotStore
from ..transfer.validation import PeerValues
from .guard import RuleGuard
from .outcomes import Outcomes
from .progress import Progress

__all__ = ["WAIT_SLACK_S", "Mode", "ModeContext", "OuterHook", "Services", "Step", "StepOutcome", "Update"]

WAIT_SLACK_S = 0.2  # update_wait returns at most this long after a request's deadline

# What an update_wait did: a call's outcome (dpwa.wire.calls.Outcome), or "no_fetch": no exchange was started this
# step, in either mode (a public name, older than mode symmetric), or an exchange in doubt
StepOutcome = Literal[
    "ok", "no_fetch", "timeout", "refused", "rejected", "failed", "expired", "cancelled", "in_doubt", "rule_broken"
]


@dataclass(frozen=True)
class Update:
    """What one update_wait did, for logging."""

    averaged: bool  # True if a peer's parameters were blended in
    outcome: StepOutcome
    peer: str | None = None  # the peer asked (fetched from, or exchanged with), if any
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
    named one (:class:`~dpwa.gossip.exchange.outer.OuterStep`, ``outer:``), or one given to the node (the
    PyTorch adapter's ``outer_optimizer``)."""

    def apply(self) -> None:
        """After a blend: one outer step; the parameters continue from its result."""

    def reanchor(self) -> None:
        """The parameters were replaced (a join, a restore): start afresh from them."""


class Services(Protocol):
    """What a mode uses of the node's services (:class:`dpwa.gossip.services.NodeServices` builds them, in the
    layer above): the snapshot store, the clients and their reply reader, what serves our snapshots, the bulk
    server and the peers' same-host slots. ``direct``, ``bulk`` and ``streams_in`` are None when unused."""

    @property
    def peers(self) -> dict[str, NodeSpec]: ...
    @property
    def local(self) -> tuple[str, ...]: ...
    @property
    def store(self) -> SnapshotStore: ...
    @property
    def values(self) -> PeerValues: ...
    @property
    def sender(self) -> Sender | None: ...
    @property
    def reader(self) -> ReplyReader: ...
    @property
    def client(self) -> ClientThread: ...
    @property
    def direct(self) -> DirectClient | None: ...
    @property
    def bulk(self) -> BulkServer | None: ...
    @property
    def serving(self) -> Serving: ...
    @property
    def paths(self) -> PeerPaths: ...
    @property
    def streams_in(self) -> tuple[ClientThread, ReplyReader] | None: ...
    def slot_readers(self) -> dict[str, PeerSlots]: ...


@dataclass
class ModeContext:
    """What a mode's steps work with: the node's services and the state they share (training thread)."""

    name: str
    config: Config
    params: FlatParams
    model: WireModel
    services: Services
    flow: FlowControl
    progress: Progress
    counters: Counters
    outcomes: Outcomes
    rule: Rule  # how f is chosen and each half applied (dpwa.mixing.rules)
    guard: RuleGuard  # applies each half of the rule, checked (dpwa.gossip.exchange.guard)
    publish: Callable[[float | None], None]  # publish a snapshot with this loss (and the clock as it is)
    state: Callable[[], str] = field(default=lambda: "training")
    outer: OuterHook | None = None  # outer: nesterov or noloco, or one given to the node

    def blended(self) -> None:
        """After each blend of an exchange this node started: the outer step, if it takes one. (A half
        mirrored for a peer takes none: its change is part of the next pseudo-gradient.)"""
        if self.outer is not None:
            self.outer.apply()


class Mode(Protocol):
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

    def apply_settled(self) -> int:
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
