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

from ..logs import logger
from ..mixing.rules import Side
from ..wire.calls import Call
from ..wire.server import Route
from .requesting import FetchTask
from .snapshots import Snapshot
from .steps import Crew, Step, Update

__all__ = ["PullSteps"]


class PullSteps:
    """Fetch, then blend: :class:`~dpwa.gossip.steps.Steps` for mode pull."""

    def __init__(self, crew: Crew) -> None:
        self._crew = crew
        self.wakeup = threading.Event()  # nothing settles in the background in mode pull: never set

    def routes(self) -> dict[str, Route]:
        return {}

    def start(self, step: Step) -> bool:
        crew = self._crew
        parts, reader = crew.parts, crew.parts.reader
        candidates = crew.flow.candidates()
        peer = candidates[0] if candidates else None
        if peer is not None:
            # a deadline that follows the peer's link (dpwa.gossip.deadlines): timeout_ms at least
            step.deadline = time.monotonic() + crew.flow.deadlines.deadline_s(peer, FetchTask.timed)
            task = FetchTask(peer, step.deadline, crew.name, reader)
            # A same-host reply names a slot the peer may rewrite before update_wait: the Tx thread locks it
            # at once. Other small replies wait in ZeroMQ's queue, and the training thread takes them.
            direct = parts.direct if parts.direct is not None and not reader.wants_shm(peer) else None
            step.call = direct.start(task) if direct is not None else parts.client.submit(task)
            crew.counters.add("fetches_started")
        crew.publish(step.send_loss)  # after the fetch started: the copy overlaps with the request
        if step.call is not None and crew.rule.uses_own_snapshot:
            step.own = parts.store.lease()  # the snapshot the delta is taken from
        return step.call is not None

    def finish(self, step: Step, own_loss: float | None) -> Update:
        crew = self._crew
        progress = crew.progress
        call = step.call
        if call is None:
            return Update(False, "no_fetch", reason="no fetch was started this step", clock=progress.clock)
        if not call.done.is_set():
            call.abandon()
            crew.outcomes.timed_out(call.peer)
            return Update(
                False, "timeout", call.peer, reason="the Tx thread did not finish in time", clock=progress.clock
            )
        crew.outcomes.record(call)
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
        start = step.own if step.own is not None or not crew.guard.checked else crew.parts.store.lease()
        try:
            return self._blend(step, call, own, start.snapshot.array if start is not None else None, own_loss)
        finally:
            if start is not None and start is not step.own:
                start.release()

    def _blend(
        self, step: Step, call: Call, own: Snapshot | None, start: np.ndarray | None, own_loss: float | None
    ) -> Update:
        crew = self._crew
        progress = crew.progress
        with call.take() as received:
            peer_clock, peer_loss = received.header["clock"], received.header["loss"]
            try:
                carried = crew.rule.checked_carried(received.header.get("carry"))
            except ValueError as exc:  # nothing of it is used
                crew.counters.add("rejected.bad_carry")
                crew.flow.record(call.peer, "rejected")
                logger.warning("%s: snapshot from %s refused: bad_carry: %s", crew.name, call.peer, exc)
                return Update(False, "rejected", call.peer, reason=f"bad_carry: {exc}", clock=progress.clock)
            f = crew.rule.factor(Side(progress.clock, own_loss), Side(peer_clock, peer_loss, carried))
            own_array = own.array if own else None
            f = crew.guard.apply(
                "blend",
                functools.partial(crew.rule.blend, crew.params, own_array, received.array, f, crew.model.kept),
                start,
                crew.model.kept,
            )
        if crew.guard.broken is not None:
            return Update(False, "rule_broken", call.peer, reason=crew.guard.broken, clock=progress.clock)
        if f == 0.0:  # the rule moved nothing (push-sum: the snapshot came with no weight): not a blend
            crew.counters.add("blends_empty")
            reason = "the rule gave the peer's snapshot weight 0: nothing moved"
            return Update(
                False, "ok", call.peer, factor=0.0, reason=reason, latency_s=call.latency_s, clock=progress.clock
            )
        crew.blended()
        progress.set_clock(crew.rule.clock(progress.clock, own.clock if own else 0.0, peer_clock, f))
        crew.counters.add("averaged")
        crew.counters.add(f"peer.{call.peer}.averaged")
        return Update(True, "ok", call.peer, factor=f, latency_s=call.latency_s, clock=progress.clock)

    def abandon(self, step: Step) -> None:
        if step.call is not None:
            step.call.abandon()
            self._crew.counters.add("fetches_abandoned")

    def tend(self) -> int:
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
