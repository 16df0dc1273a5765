"""A dpwa node: one model, an Rx thread that serves it, a Tx thread that asks peers.

The training thread calls :meth:`Node.update_send` before each batch and
:meth:`Node.update_wait` after it::

    with Node("cluster.yaml", "w1", NumpyParams(weights)) as node:
        loss = None                    # no loss before the first batch
        for batch in batches:
            node.update_send(loss)     # publish a snapshot; maybe start an exchange
            loss = train(batch)        # the exchange runs meanwhile on the Tx thread
            node.update_wait(loss)     # blend the peer's parameters in place

``Node`` is a facade: it wires the parts together and forwards. The parts own their state:

* :class:`~dpwa.gossip.services.NodeServices`: everything the node runs (snapshots,
  the Rx and Tx threads, the bulk server, the join server), built in order and
  closed in reverse;
* the mixing mode, chosen once: :class:`~dpwa.gossip.exchange.pull.PullMode` or
  :class:`~dpwa.gossip.exchange.symmetric.SymmetricMode` (:mod:`dpwa.gossip.exchange.steps`);
* :class:`~dpwa.gossip.membership.flow.FlowControl` (whom to ask) and
  :class:`~dpwa.gossip.exchange.outcomes.Outcomes` (how each finished request counts);
* :class:`~dpwa.gossip.exchange.progress.Progress`: the training thread's clock and loss;
* :class:`~dpwa.gossip.membership.barrier.BarrierWaiter`: waiting at barriers;
* :class:`~dpwa.gossip.reporting.Reporter`: ``stats()`` and status;
* with open membership (``bootstrap:``), :class:`~dpwa.gossip.membership.members.Members`:
  the view of who is in the cluster; the node's peers follow it between steps.

Only the training thread writes the model: fetched snapshots (mode pull), and
both halves of symmetric exchanges, are applied in ``update_wait`` (or while
lingering, at a barrier, or at close).
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..config import pointless_settings
from ..logs import logger
from ..mixing.model import WireModel
from ..mixing.params import FlatParams
from ..stats import Counters
from .exchange.guard import RuleGuard
from .exchange.outcomes import Outcomes
from .exchange.outer import OuterStep
from .exchange.progress import Progress, loss_value
from .exchange.pull import PullMode
from .exchange.steps import WAIT_SLACK_S, Mode, ModeContext, OuterHook, Step, Update
from .exchange.symmetric import SymmetricMode
from .membership.barrier import BARRIER, BarrierCounts, BarrierServer, BarrierWaiter, dead_peer_s
from .membership.deadlines import cap_s
from .membership.flow import FlowControl
from .membership.members import MembersServer
from .membership.refresh import BootstrapRefresh
from .membership.relayed import reached_at
from .reporting import Reporter, StatusServer
from .services import NodeServices
from .settings import pairing_of, rule_of, start_share_of
from .setup import ConfigSource, identify, node_keys, open_membership
from .start import AtStart, find_members, join_wait_s, start_together, take_state
from .transfer.extras import Extras, RuleState
from .transfer.join import JOIN_CHUNK, JOIN_INFO, ExtraState, Joined
from .transfer.protocol import BULK_EXCHANGE, CONFIRM, EXCHANGE, FETCH, MAX_CLOCK, SHM_EXCHANGE, NodeState

__all__ = ["LINGER_KINDS", "Node", "Update", "WAIT_SLACK_S"]

# What a peer still training asks of a lingering node (linger stays up while these are served): its fetches,
# its exchanges and their confirms, its barriers, and a joiner's state. Not status requests, membership news
# (live peers send it now and then, for ever), nor a closing peer's acks and queries of what we know.
LINGER_KINDS = tuple(kind.name for kind in (FETCH, EXCHANGE, SHM_EXCHANGE, BULK_EXCHANGE, CONFIRM, BARRIER))
LINGER_KINDS += (JOIN_INFO.name, JOIN_CHUNK.name)


class Node:
    """One participant of pairwise gossip averaging.

    Args:
        config: a :class:`Config`, a path to a YAML file, or parsed YAML data.
        name: which node of the config this process is (None with ``nodes: torchrun``: ``rank<RANK>``).
        params: the model as a :class:`~dpwa.mixing.params.FlatParams`.
        rng: randomness for the decision to start an exchange and the peer choice (seed it for tests).
        extra: state a joining peer takes too, besides the parameters (an optimizer's).
        outer: an outer step of the caller's, taken after each blend of an exchange this node
            started, instead of the one ``outer:`` names (which must then be ``none``); restarted
            (:meth:`OuterHook.reanchor`) after a join or a restore, its state never sent to a joiner
            nor kept by :meth:`outer_state`. The PyTorch adapter's ``outer_optimizer`` is one.
    """

    def __init__(
        self,
        config: ConfigSource,
        name: str | None,
        params: FlatParams,
        *,
        rng: random.Random | None = None,
        extra: ExtraState | None = None,
        outer: OuterHook | None = None,
    ) -> None:
        who = identify(config, name)  # raises before any socket exists
        self.config, self.name, self.spec = who.config, who.name, who.spec
        if self.config.wire_dtype == "auto":  # the model's own dtype, or float32
            self.config = dataclasses.replace(self.config, wire_dtype=params.natural_wire)
        if outer is not None and self.config.outer != "none":
            raise ValueError(
                f"{self.config.source}: outer: {self.config.outer} and an outer step given to the node "
                "(outer_optimizer) both ask for an outer step; set outer: none, or give none"
            )
        self._own_outer = outer  # the caller's outer step (not sent to joiners, not in outer_state)
        self.params = params
        self.peers = {spec.name: spec for spec in self.config.peers_of(self.name)}
        self.counters = Counters()
        self._at_start = AtStart(list(self.peers))  # the peers that asked us from their start barrier
        self.rule = rule_of(self.config)  # how this node mixes; peers that mix otherwise are refused (bad_rule)
        self._guard = RuleGuard(self.name, self.rule, params, self.counters, self.config.broken_rule)
        self.rule.cluster(max(1, self.config.members_max + 1 if self.config.bootstrap else len(self.config.nodes)))
        self.model = WireModel(
            params.fingerprint, self.config.wire_dtype, params.size, self.rule.fingerprint(), self.config.wire_options
        )
        self.wire, self.nbytes = self.model.dtype, self.model.nbytes
        self.state: NodeState = "starting"
        # the state this node took from a peer at start (or by join()), if it did; joined.rejoined tells a
        # late or restarted node (the cluster had trained) from a fresh start (the first node's initial state)
        self.joined: Joined | None = None
        self._outer = OuterStep.of(self.config, params)  # before joining: a joiner takes its peer's
        self._extra = Extras.of(optimizer=extra, outer=self._outer, rule=RuleState.of(self.rule))
        self._local_steps = 0  # steps since this node last started an exchange (period)
        self._progress = Progress()
        # open membership: the view of who is in the cluster (None: the config's node list is the cluster); with
        # keys, the keys allowed follow it. Key and certificate problems are reported before any socket exists.
        self.members, curve = open_membership(who, node_keys(who), random.Random(rng.random()) if rng else None)
        # whom barriers wait for: the config's other nodes, or (open membership) the view's other members now
        members = self.members
        self._barriers = (
            BarrierCounts([], view=members.others, max_peers=self.config.members_max)
            if members is not None
            else BarrierCounts(list(self.peers))
        )
        self._flow = FlowControl(
            self.name,
            list(self.peers),
            self.config.fetch_probability * start_share_of(self.config),
            self.config.timeout_s,
            rng or random.Random(),
            schedule=pairing_of(self.config, self.name),
            # open membership: a member that answered anything, a refusal included, is alive (issue 32's
            # walkthrough: members busy with exchanges to two dead peers answered each other only "busy")
            on_heard=self.members.heard if self.members is not None else lambda peer: None,
            # open membership: never longer than dead_after_ms (a node waiting out a deadline sends no digest)
            deadline_cap_s=cap_s(
                self.config.timeout_s, self.config.dead_after_ms / 1000 if self.members is not None else None
            ),
        )
        self._step: Step | None = None
        self._refresh: BootstrapRefresh | None = None  # open membership: a bootstrap address asked again
        self._serving = False  # the Rx thread runs (settling at close needs it)
        self._close_lock = threading.Lock()

        logger.info("%s: starting on %s; %s", self.name, self.config.bind_endpoint(self.spec), self.config.describe())
        for note in pointless_settings(self.config):
            logger.warning("%s: %s", self.name, note)
        symmetric = self.config.mode == "symmetric"
        self.services = NodeServices(
            name=self.name,
            config=self.config,
            spec=self.spec,
            params=params,
            model=self.model,
            curve=curve,
            counters=self.counters,
            barriers=self._barriers,
            state=lambda: self.state,
            extra=self._extra,
            direct=not symmetric,
            stream_to_peers=True,
            exchange_streams=symmetric,
            carry=self.rule.served if self.rule.carries else None,
            members=self.members,
            heard=self._flow.signs.heard,  # a peer that answers late, or asks us, is alive: slow, not dead
        )
        try:
            if self.services.relayed is not None and self.members is not None:  # nobody can dial us: a relay's port
                self.members.move(reached_at(self.services.relayed, self.config, self.name))
            ctx = ModeContext(
                name=self.name,
                config=self.config,
                params=params,
                model=self.model,
                services=self.services,
                flow=self._flow,
                progress=self._progress,
                counters=self.counters,
                outcomes=Outcomes(self.name, self._flow, self.counters),
                rule=self.rule,
                guard=self._guard,
                publish=self._publish,
                outer=self._outer if self._outer is not None else outer,
            )
            self._mode: Mode = SymmetricMode(ctx) if symmetric else PullMode(ctx)
            self.services.own(self._mode.close)  # after the Rx thread stops: the last decisions it made
            self._waiter = BarrierWaiter(
                self.name,
                self._barriers,
                self.services.client.submit,
                self.config.timeout_s,
                members=self.members,
                keepalive_s=self.config.suspect_after_ms / 3000.0,
                took_part=lambda peer: self.counters.get(f"peer.{peer}.averaged") > 0,  # a blend with it
                idle_after_s=self.config.suspect_after_ms / 1000.0,
                retire_after_s=(self.config.suspect_after_ms + self.config.dead_after_ms) / 1000.0,
                # a fixed cluster: a peer silent this long after taking part is dead (the view judges members)
                dead_after_s=math.inf if self.members is not None else dead_peer_s(self.config.timeout_s),
                last_sign=self._flow.signs.last,
            )
            self.services.own(self._waiter.close)
            self._reporter = Reporter(
                self.name,
                self.counters,
                self._flow,
                self._progress,
                self._barriers,
                lambda: self.state,
                self._parts_report,
                self._mode.report,
            )
            self.services.serve(
                {
                    **self.services.serving.routes(),
                    **self._mode.routes(),
                    **BarrierServer(self._barriers, list(self.peers), self.members).routes(),
                    **self.services.joins.routes(),
                    **StatusServer(self._reporter.status, self._at_start.heard).routes(),
                    **(MembersServer(self.members).routes() if self.members is not None else {}),
                }
            )
            self._serving = True
            self._start(who.met)
        except BaseException:
            self.close()
            raise
        self.state = "training"

    def _start(self, met: Any) -> None:
        """Join (join: auto), publish our state, and start together with the others (see dpwa.gossip.start)."""
        trained = False
        if self.members is not None:
            self._start_open()
            return
        if self.config.join == "auto" and self.peers:
            self.state = "joining"
            self.joined, trained = self._take_state()
            self._took_state(self.joined)
        self._publish(None)  # our state, for a peer that joins now, and for peers' fetches and exchanges
        # Like DDP's constructor, return once every node holds the same initial state: nobody trains
        # alone because it started first (a late or restarted node joins a cluster that trains).
        self.state = "at_barrier"
        if met is not None:
            met.start_barrier()
        elif self.config.join == "auto" and self.peers and not trained:
            start_together(
                self.name,
                list(self.peers),
                self.services.client.submit,
                self.config.timeout_s,
                join_wait_s(self.config),
                self._at_start,
            )

    def _start_open(self) -> None:
        """Open membership: find the members through a bootstrap address, join from them (join: auto) as a
        late node does, and publish our state. No start barrier: the cluster is whoever is there."""
        assert self.members is not None
        answerer = find_members(
            self.name, self.config, self.members, self.services.endpoints, self.services.client.submit
        )
        self._refresh = BootstrapRefresh(
            self.name, self.config, self.members, self.services.endpoints, self.services.client.submit
        )
        self._sync_members()
        others = self._flow.peers()
        if self.config.join == "auto" and others:
            self.state = "joining"
            order = [answerer, *(p for p in others if p != answerer)] if answerer else [self.name, *others]
            self.joined, _ = self._take_state(order=order)
            self._took_state(self.joined)
        self._publish(None)

    def _sync_members(self) -> None:
        """(The training thread) Open membership: our peers follow the view (members come and go), and a
        bootstrap address is asked again while no member is at one (see dpwa.gossip.membership.refresh)."""
        if self.members is not None:
            if self._refresh is not None:
                self._refresh.ask_if_due()
            self.members.sync(self._flow, self.services.endpoints, gone=self._mode.forget)

    def _take_state(
        self, trained_only: bool = False, wait_s: float | None = None, order: list[str] | None = None
    ) -> tuple[Joined | None, bool]:
        return take_state(
            self.name,
            self.config,
            self.params,
            self.model,
            self._extra,
            self.services.client.submit,
            self._flow,
            self._progress,
            self._barriers,
            self.counters,
            trained_only=trained_only,
            wait_s=wait_s,
            order=order,
        )

    def join(self, wait_s: float = 60.0) -> bool:
        """Take a trained peer's state now, waiting up to `wait_s` for a peer that has trained.

        For a node started again together with its peers (torchrun restarts
        every worker): the others restore their own state first, and this one,
        which has none, then joins from them. Returns True if it took a state.
        """
        self._check_open()
        previous, self.state = self.state, "joining"
        try:
            joined, _ = self._take_state(trained_only=True, wait_s=wait_s)
        finally:
            self.state = previous
        if joined is not None:
            self.joined = joined
            self._took_state(joined)
            self._publish(self._progress.loss)
        return joined is not None

    def _took_state(self, joined: Joined | None) -> None:
        """After a join: an outer step the donor's state did not include starts afresh from its parameters
        (the caller's own always does)."""
        taken = joined.extra_state if joined is not None else None
        if self._outer is not None and joined is not None and not (isinstance(taken, dict) and "outer" in taken):
            self._outer.reanchor()
        if self._own_outer is not None and joined is not None:
            self._own_outer.reanchor()

    def _publish(self, loss: float | None) -> None:
        if self.services.publish(self._progress.clock, loss) and self.rule.carries:
            snapshot = self.services.store.current()  # (we are its one publisher: this is the one just made)
            if snapshot is not None:
                self.rule.published(snapshot.version)

    # ----------------------------------------------------------------- training thread

    def update_send(self, loss: Any = None, batch_size: float = 1) -> bool:
        """Publish the current parameters, clock and loss; maybe start an exchange (mode pull: a fetch).

        Call it before each batch. `batch_size` is added to the clock once the
        batch is done (the default 1 makes the clock count batches). Returns
        True if a request was started; :meth:`update_wait` collects it.
        """
        if self._alone():
            return False
        self._check_open()
        if not (isinstance(batch_size, (int, float)) and 0 <= batch_size <= MAX_CLOCK) or isinstance(batch_size, bool):
            raise ValueError(f"batch_size must be a number in [0, {MAX_CLOCK:g}], got {batch_size!r}")
        if self._step is not None:  # update_wait was skipped: count the batch, let go of its exchange
            self._abandon_step()
        self._tend()
        if self._alone():  # a half served broke the rule just now (broken_rule: alone)
            return False
        self._progress.sent(time.monotonic())
        step = self._step = Step(float(batch_size), loss_value(loss))
        self._local_steps += 1
        if self._local_steps < self.config.period:  # a local step: publish (peers may ask), exchange nothing
            self._publish(step.send_loss)
            return False
        self._local_steps = 0  # this step's turn is taken (fetch_probability and pairing decide whether it asks)
        return self._mode.start(step)

    def update_wait(self, loss: Any = None) -> Update:
        """Finish the step: wait for the request started by update_send, if any, and blend in place.

        Returns at once when no request was started, and never waits longer
        than ``timeout_ms`` plus a small slack. When the request failed the
        parameters are left as they are. `loss` is this batch's loss (the
        loss given to update_send is used when it is None).
        """
        if self._alone():
            return Update(False, "rule_broken", reason=str(self._guard.broken), clock=self._progress.clock)
        self._check_open()
        progress = self._progress
        step, self._step = self._step, None
        if step is None:
            self._tend()
            return Update(False, "no_fetch", reason="no update_send before this update_wait", clock=progress.clock)
        progress.set_clock(progress.clock + step.batch)
        own_loss = loss_value(loss)
        if own_loss is None:
            own_loss = step.send_loss
        progress.loss = own_loss if own_loss is not None else progress.loss
        progress.rate.sample(time.monotonic(), self.counters.get("averaged") + self.counters.get("mirrored"))
        try:
            if step.call is not None:
                step.call.wait(max(0.0, step.deadline + WAIT_SLACK_S - time.monotonic()))
            update = self._mode.finish(step, own_loss)
            if step.call is not None and update.outcome not in ("ok", "in_doubt"):
                self._local_steps = self.config.period  # the exchange failed: try again at the next step
        finally:
            if step.own is not None:
                step.own.release()
        if self._alone():  # the rule broke in this step (broken_rule: alone)
            return Update(False, "rule_broken", update.peer, reason=str(self._guard.broken), clock=progress.clock)
        return update

    def _alone(self) -> bool:
        """True once this node's rule broke (dpwa.gossip.exchange.guard). The first time, its gossip closes (peers see
        it leave). Under ``broken_rule: alone`` it trains on without averaging; under ``raise`` (the error was
        raised already) a later call raises."""
        if self._guard.broken is None:
            return False
        if self.state not in ("closing", "closed"):
            logger.error("%s: closing its gossip: its rule broke (%s)", self.name, self._guard.broken)
            self.close()
        if self.config.broken_rule == "raise":
            raise RuntimeError(f"dpwa node {self.name!r}: its rule broke ({self._guard.broken}); its gossip is closed")
        return True

    def _abandon_step(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        self._progress.set_clock(self._progress.clock + step.batch)
        self._mode.abandon(step)
        if step.own is not None:
            step.own.release()

    def _tend(self) -> int:
        """Between steps: drop finished stray calls, offer our state to a joiner, apply what settled; with open
        membership, our peers follow the view."""
        self._sync_members()
        self._waiter.tidy()
        if self.services.joins.wanted.is_set() and self.state in ("at_barrier", "lingering"):
            self._publish(self._progress.loss)  # a peer is joining while we make no steps: offer our state as of now
        return self._mode.apply_settled()

    def _idle(self) -> None:
        """While making no steps (lingering, at a barrier): keep taking part."""
        self._sync_members()
        self._waiter.tidy()
        if self.services.joins.wanted.is_set():
            self._publish(self._progress.loss)
        self._mode.idle()

    # ----------------------------------------------------------------- without training

    def linger(self, idle_s: float, limit_s: float, stop: Callable[[], bool] = lambda: False) -> float:
        """Keep serving peers, without training, until none was served for `idle_s` (or `limit_s` passed).

        A node that finishes first and exits would cost each remaining peer a
        request timeout per step; staying up while it is still asked avoids
        it. Only requests actually served count (not refusals), and only those a peer still training sends
        (:data:`LINGER_KINDS`): not a status request, nor what a closing peer sends (acks, queries of what we
        know) or a live one's membership news, which would keep finished nodes up one after another. In mode
        symmetric the exchanges peers confirm are applied, and a new snapshot
        is published after each, so a lingering node keeps taking part.
        Returns the time spent.
        """
        if self._alone():
            return 0.0
        self._check_open()
        self._abandon_step()
        self.state = "lingering"
        start = last_change = time.monotonic()

        def served() -> int:  # what peers still training ask for
            return sum(self.counters.get(f"served.{kind}") for kind in LINGER_KINDS)

        last = served()
        wakeup = self._mode.wakeup
        try:
            while not stop() and time.monotonic() - start < limit_s:
                wakeup.clear()
                self._idle()
                now_served = served()
                if now_served != last:
                    last, last_change = now_served, time.monotonic()
                elif time.monotonic() - last_change >= idle_s:
                    break
                wakeup.wait(0.02)  # woken by a commit; else a bounded poll while the Rx thread serves
        finally:
            self.state = "training"
        return time.monotonic() - start

    def barrier(
        self,
        name: str = "epoch",
        timeout_s: float | None = None,
        missing: str = "raise",
        stop: Callable[[], bool] = lambda: False,
    ) -> list[str]:
        """Wait until every node has made as many calls of barrier `name` as this one (this call included).

        The k-th call returns once every node of the cluster has made its k-th
        call with this name, or a later one (with ``bootstrap:``, every member of this node's view
        at the time, re-read while it waits). There is no master: each node
        tells its peers its counters and asks for theirs (see
        :mod:`dpwa.gossip.membership.barrier`). Meanwhile the node keeps serving its
        peers, and settled exchanges are applied. A node that has closed or
        died never arrives: after `timeout_s` (None: wait for ever) this raises
        :class:`~dpwa.gossip.membership.barrier.BarrierTimeout` naming the missing nodes,
        or, with ``missing="proceed"``, logs them and returns their names.
        Returns the nodes skipped ([] when everyone arrived); with ``bootstrap:``
        that includes members this node never blended with that were all it
        waited for during ``suspect_after_ms`` (whatever `missing` says; see
        :mod:`dpwa.gossip.membership.barrier`). `stop` is
        asked between polls: once it returns True (a SIGTERM, say) the wait
        ends at once and returns the nodes not yet arrived, whatever
        `missing` says; this call still counts as made. A node whose rule broke under ``broken_rule: alone``
        waits for nobody: it returns its peers' names at once.
        """
        if self._alone():
            return sorted(self.peers)
        self._check_open()
        if missing not in ("raise", "proceed"):
            raise ValueError(f"missing must be 'raise' or 'proceed', got {missing!r}")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s >= 0):
            raise ValueError(f"timeout_s must be a number of seconds >= 0 or None, got {timeout_s!r}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", name):
            raise ValueError(f"a barrier name is 1 to 32 letters, digits, '_', '.' or '-', got {name!r}")
        k = self._barriers.arrive(name)
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        previous, self.state = self.state, "at_barrier"
        try:
            return self._waiter.wait(name, k, deadline, missing, stop, self._idle)
        finally:
            self.state = previous

    def barrier_counters(self) -> dict[str, int]:
        """How many calls of each barrier this node has made (for a checkpoint)."""
        return self._barriers.own()

    def outer_state(self) -> dict[str, Any] | None:
        """For a checkpoint: the outer step's anchor, momentum and step count (None with ``outer: none``)."""
        return self._outer.state() if self._outer is not None else None

    def rule_state(self) -> dict[str, Any] | None:
        """(The training thread) for a checkpoint: the mixing rule's per-node state, ``{"rule": its name,
        "state": Rule.state()}`` (numbers, strings, lists and maps: what a joiner takes from its donor;
        ClippedGossip with ``radius: auto``: its recent distances). None when the rule keeps none."""
        state = self.rule.state()  # read by the training thread, as a donor's capture reads it
        return {"rule": self.rule.name, "state": state} if state else None

    def _checked_rule_state(self, saved: Any) -> Any:
        """A checkpoint's :meth:`rule_state`, checked by this node's rule exactly as a donor's state is."""
        source = "a checkpoint's rule state"
        if not isinstance(saved, Mapping) or set(saved) != {"rule", "state"}:
            got = sorted(map(str, saved))[:4] if isinstance(saved, Mapping) else type(saved).__name__
            raise ValueError(f"{source}: must be a mapping of rule and state (rule_state()'s), got {got!s:.80}")
        name, part = saved["rule"], RuleState.of(self.rule)
        if not isinstance(name, str) or name != self.rule.name:
            raise ValueError(f"{source}: saved under rule {name!r:.40}, but this node's rule is {self.rule.name!r}")
        if part is None:
            settings = f" (its settings: {self.rule.settings})" if self.rule.settings else ""
            raise ValueError(f"{source}: saved under rule {name!r}, but this node's rule keeps no state{settings}")
        return part.checked(saved["state"], source)

    def restore(
        self,
        clock: float | None = None,
        barriers: Mapping[str, int] | None = None,
        outer: Mapping[str, Any] | None = None,
        rule: Mapping[str, Any] | None = None,
    ) -> None:
        """Resume from a checkpoint, after the model's parameters were loaded: set the clock, barrier
        counters (a count never goes down), the outer step's state (:meth:`outer_state`'s; without
        it, an outer step starts afresh from the parameters as they are now; an outer step given to the
        constructor always does) and the mixing rule's state (:meth:`rule_state`'s; without it, the
        rule's state is left as it is).

        Everything is checked before anything is taken: the outer state exactly as a donor's is
        (:func:`~dpwa.gossip.exchange.outer.checked_outer_state`: this node's rule and size, finite values within
        ±1e18, a step count), the rule's state as a donor's is (its size, then the rule's own
        ``check_state``), and it must be this node's rule's (a rule that keeps none takes none).
        A ValueError names what is wrong, and the node is left as it was."""
        self._check_open()
        if clock is not None and not (
            isinstance(clock, (int, float))
            and not isinstance(clock, bool)
            and math.isfinite(clock)
            and 0 <= clock <= MAX_CLOCK
        ):
            raise ValueError(f"clock must be a number in [0, {MAX_CLOCK:g}], got {clock!r:.40}")
        if outer is not None and self._outer is None:
            logger.warning(
                "%s: the checkpoint holds an outer step's state; outer: none here, so it is unused", self.name
            )
        checked = self._outer.checked(outer) if self._outer is not None and outer is not None else None
        rule_checked = self._checked_rule_state(rule) if rule is not None else None
        if barriers is not None:
            self._barriers.restore(barriers)  # checked whole: takes nothing if it raises
        if self._outer is not None:
            if checked is not None:
                self._outer.load(checked)
            else:
                self._outer.reanchor()
        if self._own_outer is not None:  # the caller's outer step keeps no checkpoint state here
            self._own_outer.reanchor()
        if rule is not None:
            self.rule.load_state(rule_checked)
        if clock is not None:
            self._progress.set_clock(float(clock))
        # Peers and joiners must see the restored state, not the one published when the node started (a
        # joiner took that one: the initial parameters at clock 0, while its donor restored epoch 3).
        self.services.joins.replaced()
        self._publish(self._progress.loss)

    # ----------------------------------------------------------------- reporting

    @property
    def clock(self) -> float:
        """Samples (or batches) trained, blended with peers' clocks at each average."""
        return self._progress.clock

    @property
    def rank(self) -> int:
        """This node's index in the config's node list, 0 to ``world_size - 1`` (under torchrun the list is
        in torchrun's RANK order, so this is RANK; under ``./run.sh``, the node's ``{index}``)."""
        return next(i for i, spec in enumerate(self.config.nodes) if spec.name == self.name)

    @property
    def world_size(self) -> int:
        """The number of nodes in the config's node list, this one included (under torchrun: WORLD_SIZE)."""
        return len(self.config.nodes)

    def stats(self) -> dict[str, Any]:
        """Counters (requests ok, timed out, rejected; bytes in and out; ...) and per-peer numbers."""
        return self._reporter.stats()

    def _parts_report(self) -> dict[str, Any]:
        store, bulk = self.services.store, self.services.bulk
        out: dict[str, Any] = {
            "snapshot_slots": store.slots,
            "publish_skipped": store.skipped,
            "slots_retired": store.retired,
            "slots_lent": store.lent,  # a peer's snapshot received into our own slot nobody held
            # every blend that moved this node, whichever side started the exchange: `averaged` counts the
            # requester's halves, `mirrored` the server's (one symmetric exchange is a blend on both nodes)
            "blends": self.counters.get("averaged") + self.counters.get("mirrored"),
        }
        if bulk is not None:
            out["bulk_pending"] = bulk.pending()
        out.update({f"rule.{key}": value for key, value in self.rule.report().items()})
        if self.members is not None:
            out.update(self.members.report())
        return out

    # ----------------------------------------------------------------- lifecycle

    def _check_open(self) -> None:
        if self.state in ("closing", "closed"):
            raise RuntimeError(f"dpwa node {self.name!r} is closed")

    @property
    def alive(self) -> bool:
        """True while both the Rx and the Tx thread run (they survive any message a peer sends)."""
        return self._serving and self.services.server.alive and self.services.client.alive

    @property
    def closed(self) -> bool:
        return self.state == "closed"

    def close(self, timeout_s: float = 5.0) -> None:
        """Settle what is pending, stop both threads, close every socket with linger 0, free the port.

        Idempotent; bounded by about `timeout_s` per stage. In mode pull, a
        fetch in flight is abandoned. In mode symmetric, exchanges are settled first by the
        rule of :mod:`dpwa.gossip.exchange.driver` (new ones refused; confirms still
        answered; in-doubt ones still asked), within `timeout_s`; committed
        halves are applied, so the model may change here. Logs an error if a
        thread is still alive after that. Shared-memory slot files are deleted.
        """
        with self._close_lock:
            if self.state in ("closing", "closed"):
                return
            self.state = "closing"
        try:
            self._abandon_step()
            if self._refresh is not None:
                self._refresh.close()
            if self._serving:
                self._mode.settle(time.monotonic() + timeout_s)
            self.services.close(timeout_s)
        finally:
            self.state = "closed"
        logger.info("%s: closed", self.name)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
