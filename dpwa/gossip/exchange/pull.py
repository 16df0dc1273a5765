"""Mode pull (the original): a node fetches a peer's snapshot at update_send and blends it at update_wait.

Only the requester moves; the peer serves its snapshot and goes on. The
fetch starts before our own snapshot is copied, so the two overlap. A small
model's fetch from a peer on another machine runs on the training thread
itself (:class:`~dpwa.wire.client.DirectClient`); the rest on the Tx thread.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import numpy as np

from ...logs import logger
from ...mixing.rules import Side
from ...wire.calls import Call
from ...wire.server import Route
from ..transfer.requesting import FetchTask
from ..transfer.snapshots import Snapshot
from .steps import ModeContext, Step, Update

__all__ = ["PullMode"]


class PullMode:
    """Fetch, then blend: :class:`~dpwa.gossip.exchange.steps.Mode` for mode pull."""

    def __init__(self, ctx: ModeContext) -> None:
        self._ctx = ctx
        self.wakeup = threading.Event()  # nothing settles in the background in mode pull: never set

    def routes(self) -> dict[str, Route]:
        return {}

    def start(self, step: Step) -> bool:
        ctx = self._ctx
        services, reader = ctx.services, ctx.services.reader
        candidates = ctx.flow.candidates()
        peer = candidates[0] if candidates else None
        if peer is not None:
            # a deadline that follows the peer's link (dpwa.gossip.membership.deadlines): timeout_ms at least
            step.deadline = time.monotonic() + ctx.flow.deadlines.deadline_s(peer, FetchTask.timed)
            task = FetchTask(peer, step.deadline, ctx.name, reader)
            # A same-host reply names a slot the peer may rewrite before update_wait: the Tx thread locks it
            # at once. Other small replies wait in ZeroMQ's queue, and the training thread takes them.
            direct = services.direct if services.direct is not None and not services.paths.reads_slot(peer) else None
            step.call = direct.start(task) if direct is not None else services.client.submit(task)
            ctx.counters.add("fetches_started")
        ctx.publish(step.send_loss)  # after the fetch started: the copy overlaps with the request
        if step.call is not None and ctx.rule.uses_own_snapshot:
            step.own = services.store.lease()  # the snapshot the delta is taken from
        return step.call is not None

    def finish(self, step: Step, own_loss: float | None) -> Update:
        ctx = self._ctx
        progress = ctx.progress
        call = step.call
        if call is None:
            return Update(False, "no_fetch", reason="no fetch was started this step", clock=progress.clock)
        if not call.done.is_set():
            call.abandon()
            ctx.outcomes.timed_out(call.peer)
            return Update(
                False, "timeout", call.peer, reason="the Tx thread did not finish in time", clock=progress.clock
            )
        ctx.outcomes.record(call)
        if call.outcome != "ok":
            return Update(
                False,
                call.outcome or "failed",
                call.peer,
                reason=call.reason,
                latency_s=call.latency_s,
                clock=progress.clock,
            )
        own = step.own.snapshot if step.own is not None else None
        # a guarded rule that breaks sets the model back to the snapshot published at update_send
        start = step.own if step.own is not None or not ctx.guard.checked else ctx.services.store.lease()
        try:
            return self._blend(step, call, own, start.snapshot.array if start is not None else None, own_loss)
        finally:
            if start is not None and start is not step.own:
                start.release()

    def _blend(
        self, step: Step, call: Call, own: Snapshot | None, start: np.ndarray | None, own_loss: float | None
    ) -> Update:
        ctx = self._ctx
        progress = ctx.progress
        with call.take() as received:
            peer_clock, peer_loss = received.header["clock"], received.header["loss"]
            try:
                carried = ctx.rule.checked_carried(received.header.get("carry"))
            except ValueError as exc:  # nothing of it is used
                ctx.counters.add("rejected.bad_carry")
                ctx.flow.record(call.peer, "rejected")
                logger.warning("%s: snapshot from %s refused: bad_carry: %s", ctx.name, call.peer, exc)
                return Update(False, "rejected", call.peer, reason=f"bad_carry: {exc}", clock=progress.clock)
            f = ctx.rule.factor(Side(progress.clock, own_loss), Side(peer_clock, peer_loss, carried))
            own_array = own.array if own else None
            f = ctx.guard.apply(
                "blend",
                functools.partial(ctx.rule.blend, ctx.params, own_array, received.array, f, ctx.model.kept),
                start,
                ctx.model.kept,
            )
        if ctx.guard.broken is not None:
            return Update(False, "rule_broken", call.peer, reason=ctx.guard.broken, clock=progress.clock)
        if f == 0.0:  # the rule moved nothing (push-sum: the snapshot came with no weight): not a blend
            ctx.counters.add("blends_empty")
            reason = "the rule gave the peer's snapshot weight 0: nothing moved"
            return Update(
                False, "ok", call.peer, factor=0.0, reason=reason, latency_s=call.latency_s, clock=progress.clock
            )
        ctx.blended()
        progress.set_clock(ctx.rule.clock(progress.clock, own.clock if own else 0.0, peer_clock, f))
        ctx.counters.add("averaged")
        ctx.counters.add(f"peer.{call.peer}.averaged")
        return Update(True, "ok", call.peer, factor=f, latency_s=call.latency_s, clock=progress.clock)

    def abandon(self, step: Step) -> None:
        if step.call is not None:
            step.call.abandon()
            self._ctx.counters.add("fetches_abandoned")

    def apply_settled(self) -> int:
        return 0

    def idle(self) -> None:
        pass

    def settle(self, deadline: float) -> None:
        pass

    def close(self) -> None:
        pass

    def forget(self, peer: str) -> None:
        pass  # a pull holds nothing against a peer

    def report(self) -> dict[str, Any]:
        return {"pending": 0}
