"""Mode symmetric: both sides of an exchange move, and the mean of all nodes is kept.

At update_send a node publishes its snapshot and sends it with an exchange
request (to a peer on the same machine: the name of the shared-memory slot it
is in; a large model's to a peer on another host: a ticket to stream it from
our bulk port); the server answers with its own and both apply their halves, or
neither (the protocol and its guarantee are in :mod:`dpwa.gossip.exchange.machine`, driven by
:mod:`dpwa.gossip.exchange.driver`).
This module runs that protocol on the node's training thread: it owns the
exchange server (Rx side) and client (exchanges in doubt), applies committed
halves as they settle, and settles what is pending before the node closes.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from ...logs import logger
from ...mixing.rules import Side
from ...wire.calls import Call
from ...wire.errors import Refused
from ...wire.server import Route
from ..transfer.paths import Path
from ..transfer.snapshots import Lease
from .driver import AckQueries, ClientHalf, ExchangeClient, ExchangeServer, ExchangeTask, InDoubt
from .machine import Settling
from .steps import ModeContext, Step, Update

__all__ = ["BUSY_RETRY_MIN_S", "BUSY_RETRY_STEPS", "EXCHANGE_PEERS_MAX", "SymmetricMode"]

BUSY_RETRY_STEPS = 1.5  # an exchange asks busy peers again for this many of our steps (within its deadline) ...
BUSY_RETRY_MIN_S = 0.02  # ... and at least this long
EXCHANGE_PEERS_MAX = 8  # the candidates one exchange asks (in turn, while they answer busy), at most


class SymmetricMode:
    """Exchange, then both apply: :class:`~dpwa.gossip.exchange.steps.Mode` for mode symmetric."""

    def __init__(self, ctx: ModeContext) -> None:
        self._ctx = ctx
        config, services = ctx.config, ctx.services
        self.server = ExchangeServer(
            ctx.name,
            services.serving,
            services.values,
            ctx.rule,
            config.timeout_s,
            ctx.counters,
            wait_cap_s=ctx.flow.deadlines.cap_s,  # the longest deadline a requester of ours may name
            slots=services.slot_readers(),  # same-host requesters name their snapshot's slot
            # large models between hosts: requesters offer their snapshots at their bulk ports
            streams_in=(services.streams_in[0].submit, services.streams_in[1])
            if services.streams_in is not None
            else None,
        )
        self.client = ExchangeClient(
            ctx.name,
            list(services.peers),
            config.timeout_s,
            services.client.submit,
            ctx.counters,
            ctx.flow.heard,
            ended=lambda: self.server.own_ended(self._ticket, False),
            deadlines=ctx.flow.deadlines,
        )
        self._ticket = 0  # our own unsettled exchange's (ExchangeServer.take_own)
        self._outstanding: list[Call] = []  # exchange calls whose result is not yet taken
        # which peers read our slot, or our stream, is the paths' to say (dpwa.gossip.transfer.paths); int8
        # snapshots are encoded as they are sent, with error feedback: they go as the payload, never by stream
        self._paths = services.paths
        self._streams = services.bulk is not None and not ctx.model.encoded and self._paths.offers_streams()
        self.wakeup = self.server.committed  # set when an exchange commits (a lingering node waits on it)

    def routes(self) -> dict[str, Route]:
        return {**self.server.routes(), **self.client.known.routes()}

    # ----------------------------------------------------------------- a step

    def start(self, step: Step) -> bool:
        ctx = self._ctx
        ctx.publish(step.send_loss)  # the request carries our snapshot: publish it first
        exchanges, reader = self.client, ctx.services.reader
        if not exchanges.can_start():
            return False
        # the best few: members that answer busy forever (an attacker can add hundreds) cost one step a few
        # requests at most, not one to each of them
        peers = ctx.flow.candidates(exclude=exchanges.blocked_peers())[:EXCHANGE_PEERS_MAX]
        if not peers:
            return False
        own = ctx.services.store.lease()
        if own is None:  # nothing published (every slot held at our first publish): nothing to offer
            return False
        ticket = self.server.take_own(own.snapshot.version)
        if not ticket:  # in an exchange we serve (dpwa.mixing.admission)
            own.release()
            ctx.counters.add("starts_skipped_in_exchange")
            return False
        self._ticket = ticket
        snap = own.snapshot
        common = {
            "from": ctx.name,
            "fp": ctx.model.fingerprint,
            **({"rule": ctx.model.rule} if ctx.model.rule is not None else {}),
            "dtype": ctx.model.dtype,
            "nbytes": ctx.model.nbytes,
            "clock": snap.clock,
            "loss": snap.loss,
        }

        def fields(peer: str) -> dict[str, Any]:  # (Tx thread) with open membership, a fresh digest each time
            return {**common, **({"shm": True} if self._paths.reads_slot(peer) else {}), **reader.outgoing()}

        def factor(requester: tuple[float, float | None], server: tuple[float, float | None]) -> float:
            return ctx.rule.factor(Side(*requester), Side(*server), symmetric=True)

        # the first candidate's deadline, which follows its link (dpwa.gossip.membership.deadlines): timeout_ms at least;
        # the server holds the exchange as long (wait_ms), so a slow link's confirm still finds it pending
        wait_s = ctx.flow.deadlines.deadline_s(peers[0], ExchangeTask.timed)
        common["wait_ms"] = max(1, round(wait_s * 1000))
        step.deadline = time.monotonic() + wait_s
        # A busy peer (its snapshot took part in an exchange it has not applied yet) publishes afresh at its next
        # update_send or update_wait, within about one of its steps (ours is the measure): it is asked again until
        # then, within the deadline. The retries run while this node computes its own step.
        busy_budget = max(BUSY_RETRY_MIN_S, BUSY_RETRY_STEPS * ctx.progress.step_s)
        sender = ctx.services.sender  # a codec whose encoding needs no reply first: mode symmetric allows no other
        shm_id = ctx.services.serving.shm_id
        slot = None  # a same-host peer reads our snapshot in place: the request names its slot
        if snap.shared and shm_id is not None:
            slot = {"version": snap.version, "shm_slot": snap.slot, "shm_id": shm_id}
        task = ExchangeTask(
            peers,
            step.deadline,
            own,
            fields,
            reader,
            factor,
            ctx.config.timeout_s / 10,
            busy_budget,
            encode=(lambda values: sender.encode(values, "", {}).buffer) if sender is not None else None,
            slot=slot,
            slot_to=self._paths.names_slot,
            offer=functools.partial(self._offer, own) if self._streams else None,
            withdraw=ctx.services.bulk.withdraw if ctx.services.bulk is not None else lambda token: None,
            ended=functools.partial(self.server.own_ended, ticket, False),
            ticket=ticket,
            asks=functools.partial(self.server.own_asks, ticket),
            confirms=functools.partial(self.server.own_confirms, ticket),
        )
        step.call = ctx.services.client.submit(task)
        self._outstanding.append(step.call)
        ctx.counters.add("fetches_started")  # the public name for exchanges started, in either mode
        return True

    def _offer(self, own: Lease, peer: str) -> dict[str, Any] | None:
        """(Tx thread) Offer our snapshot to `peer` at our bulk port: the ``bulk_exchange`` request's fields,
        or None (not a stream peer, or the bulk server's budget for it is spent: the payload goes instead)."""
        bulk = self._ctx.services.bulk
        if bulk is None or self._paths.outgoing(peer, time.monotonic()) != "stream":
            return None  # (not a stream peer, or not now: an exchange by stream with it failed lately)
        hold = own.share()  # the stream's own claim on the snapshot, released once sent or expired
        try:
            ticket = bulk.offer(peer, [own.snapshot.array], hold, self._ctx.config.timeout_s + 1.0)
        except Refused:
            hold.release()
            return None
        fields: dict[str, Any] = {"version": own.snapshot.version, "port": bulk.port, "token": ticket.token}
        if ticket.key is not None:
            fields["key"] = ticket.key
        fields["bulk"] = True  # theirs by stream too
        return fields

    def finish(self, step: Step, own_loss: float | None) -> Update:
        clock = self._ctx.progress
        call = step.call
        result = None
        settled = (
            call is not None and call not in self._outstanding
        )  # by apply_settled(), while the node waited (a barrier)
        if call is not None and not settled and call.done.is_set():
            self._outstanding.remove(call)
            result = self._harvest(call)
        applied = self.apply_settled() + (result.averaged if result is not None else 0)
        if applied:
            # Our snapshot is stale now (dpwa.mixing.admission): publish what the next step would, so that a
            # peer asking before our next update_send (while the loader loads, say) is not refused busy.
            self._ctx.publish(own_loss if own_loss is not None else clock.loss)
        if call is None:
            return Update(False, "no_fetch", reason="no exchange was started this step", clock=clock.clock)
        if result is None:
            why = "no outcome yet; it is settled in a later step"
            if settled:
                why = "settled and applied while the node waited"
            return Update(False, "timeout", call.peer, reason=why, clock=clock.clock)
        return result

    def abandon(self, step: Step) -> None:
        pass  # an exchange call stays outstanding: its outcome still matters

    def _harvest(self, call: Call) -> Update:
        """Take an exchange call's result: apply a committed half, keep one in doubt."""
        ctx = self._ctx
        clock = ctx.progress.clock
        task = _exchange(call)
        self._payload_from_now_on("slot", task.slot_refused)
        self._payload_from_now_on("stream", task.stream_refused)
        if call.outcome != "ok":
            task.release()  # our snapshot, if the task never ran
            self.server.own_ended(task.ticket, False)
            ctx.outcomes.record(call)
            return Update(
                False, call.outcome or "failed", call.peer, reason=call.reason, latency_s=call.latency_s, clock=clock
            )
        value = call.take()
        if isinstance(value, InDoubt):
            ctx.flow.record(call.peer, "rejected" if value.answered else "timeout", started=call.started)
            if not value.answered:  # no decision within the deadline: the next exchange is given longer
                ctx.flow.deadlines.timed_out(call.peer, ExchangeTask.timed)
            self.client.add(value)
            return Update(
                False,
                "in_doubt",
                call.peer,
                reason="the peer's decision did not arrive; it is asked again in the background",
                latency_s=call.latency_s,
                clock=clock,
            )
        ctx.outcomes.record(call)
        f = self._apply_client_half(value, task.ticket)
        if f is None:
            return Update(False, "rule_broken", call.peer, reason=str(ctx.guard.broken), clock=ctx.progress.clock)
        return Update(True, "ok", call.peer, factor=f, latency_s=call.latency_s, clock=ctx.progress.clock)

    def _payload_from_now_on(self, path: Path, refused: dict[str, str]) -> None:
        """Peers that refused our snapshot by slot or by stream (or do not know the request) get the payload from
        now on (one that could not read our slot this once is asked by slot again: PeerPaths.refused)."""
        gone = self._paths.refused(path, refused)
        if gone:
            logger.info(
                "%s: %s took no snapshot of ours by %s (%s); sending them the payload",
                self._ctx.name,
                ", ".join(sorted(gone)),
                path,
                ", ".join(sorted({refused[p] for p in gone})),
            )

    def _apply_client_half(self, half: ClientHalf, ticket: int) -> float | None:
        """Our half of a committed exchange: the weight the rule gave the peer (None: broken, not applied)."""
        ctx = self._ctx
        with half:
            own, theirs = half.own.snapshot, half.theirs
            w = ctx.guard.apply(
                "blend",
                functools.partial(ctx.rule.blend, ctx.params, own.array, theirs.array, half.f, ctx.model.kept),
                own.array,
                ctx.model.kept,
            )
            if ctx.guard.broken is None:
                ctx.progress.set_clock(ctx.rule.clock(ctx.progress.clock, own.clock, theirs.header["clock"], w))
        self.server.own_ended(ticket, True)
        self.client.hold(half)  # a closing peer that asks learns we hold its commit
        if ctx.guard.broken is not None:  # not applied here (broken_rule: alone)
            return None
        ctx.blended()
        ctx.counters.add("averaged")
        ctx.counters.add(f"peer.{half.peer}.averaged")
        return w

    # ----------------------------------------------------------------- in the background

    def apply_settled(self) -> int:
        """Apply what symmetric exchanges have settled since the last call: both sides' halves."""
        ctx = self._ctx
        applied = 0
        for half in self.server.take_committed():
            with half:
                served = half.served.snapshot
                w = ctx.guard.apply(
                    "mirror",
                    functools.partial(
                        ctx.rule.mirror, ctx.params, served.array, half.theirs.array, half.f, ctx.model.kept
                    ),
                    served.array,
                    ctx.model.kept,
                )
                if ctx.guard.broken is None:
                    their_clock = half.theirs.header["clock"]
                    ctx.progress.set_clock(ctx.rule.mirror_clock(ctx.progress.clock, served.clock, their_clock, w))
            self.server.applied()
            if ctx.guard.broken is not None:  # not applied here (broken_rule: alone)
                continue
            ctx.counters.add("mirrored")
            ctx.counters.add(f"peer.{half.peer}.averaged")
            applied += 1
        for call in [c for c in self._outstanding if c.done.is_set()]:
            self._outstanding.remove(call)
            applied += self._harvest(call).averaged
        self.client.forget_gone(ctx.flow.peers())  # open membership: a removed peer will not answer
        for client_half in self.client.poll():  # in doubt until now: our latest own exchange (nothing else started)
            applied += self._apply_client_half(client_half, self._ticket) is not None
        return applied

    def idle(self) -> None:
        """Apply settled exchanges, and publish a fresh snapshot once the current one is spent, so that
        peers still training are not refused busy."""
        applied = self.apply_settled()
        if applied or self.server.spent():
            self._ctx.publish(self._ctx.progress.loss)

    # ----------------------------------------------------------------- closing

    def settle(self, deadline: float) -> None:
        """Refuse new exchanges, and wait (bounded) until what is pending is decided and known.

        Our own exchanges must be decided, and our acks sent. Those we serve: once no confirm has come for
        the quiet time, we commit no more (a late confirm is answered abort, and its requester applies
        nothing), and we keep answering the commits we made until each requester is known to hold it.
        """
        ctx, server, client = self._ctx, self.server, self.client
        server.start_closing()
        client.send_acks()
        queries = AckQueries(server, ctx.services.client.submit, ctx.name, client.closing_deadline)
        settling = Settling()  # the rule: when to stop committing, and when we are done
        try:
            while time.monotonic() < deadline:
                self.apply_settled()
                decided = not (self._outstanding or len(client))  # our own exchanges decided
                if settling.stop_committing(time.monotonic(), decided, server.pending(), server.last_confirm):
                    server.stop_committing()
                if settling.frozen:
                    queries.ask_due()
                    if settling.done(client.acks_pending(), len(server.unacknowledged())):
                        return
                time.sleep(0.01)  # a bounded polling loop: the Rx and Tx threads work meanwhile
        finally:
            queries.close()
        unacked = server.unacknowledged()
        if len(client) or unacked:  # what may still differ between two sides (a commit whose requester never heard)
            logger.warning(
                "%s: closing with exchanges unsettled after the close deadline: %d of ours in doubt, "
                "%d commits of ours not yet known to %s",
                ctx.name,
                len(client),
                len(unacked),
                ", ".join(sorted({peer for peer, _ in unacked})) or "anyone",
            )
        else:  # only our acks were not delivered: their peers closed first (or are gone), and need them no more
            logger.info(
                "%s: closed with %d acks undelivered (those peers did not answer)", ctx.name, client.acks_pending()
            )

    def close(self) -> None:
        """After the Rx thread stopped: apply the last decisions it made, let go of everything else."""
        self.apply_settled()
        for call in self._outstanding:
            call.abandon()
            _exchange(call).release()
        self._outstanding.clear()
        self.client.close()
        self.server.close()

    def forget(self, peer: str) -> None:
        self.server.forget(peer)

    def report(self) -> dict[str, Any]:
        return {
            "pending": self.server.held() + len(self.client),
            "exchanges_pending": self.server.held(),
            "exchanges_unsettled": len(self.client),
        }


def _exchange(call: Call) -> ExchangeTask:
    task = call.task
    assert isinstance(task, ExchangeTask), task
    return task
