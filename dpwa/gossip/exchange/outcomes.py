"""How a finished request is counted, and what flow control learns from it (training thread).

One table maps each outcome of a call (:data:`dpwa.wire.calls.Outcome`) and
each refusal reason to the counter it moves; failures are logged, rate-limited
per peer and outcome. A request is an exchange this node started: in mode pull
a fetch, in mode symmetric an exchange request. The counters are named
``fetches_*`` in both modes: the names are public (``stats()``, docs/api.md),
and older than mode symmetric.
"""

from __future__ import annotations

from typing import Literal

from ...logs import RateLimitedLog
from ...stats import Counters
from ...wire.calls import Call
from ..membership.flow import FlowControl
from ..transfer.requesting import FetchTask

__all__ = ["Outcomes", "QuietRefusal"]

# Refusals that say nothing bad about the peer: its snapshot already serves an exchange, the exchange was
# aborted by its rule, or it is closing. Counted under their own name, never as the peer's failure.
QuietRefusal = Literal["busy", "aborted", "closing"]
_QUIET = ("busy", "aborted", "closing")
_FAILURE_COUNTERS = {  # outcome -> counter, for the exchanges this node started (either mode)
    "timeout": "fetches_timed_out",
    "rejected": "fetches_rejected",
    "refused": "fetches_refused",
    "cancelled": "fetches_cancelled",
    "expired": "fetches_expired",
}


class Outcomes:
    """Counts finished calls and tells flow control about them.

    Args:
        name: this node, for the log.
        flow: flow control, which learns from every outcome.
        counters: the node's counters.
    """

    def __init__(self, name: str, flow: FlowControl, counters: Counters) -> None:
        self._name, self._flow, self._counters = name, flow, counters
        self._log = RateLimitedLog()

    def record(self, call: Call) -> None:
        """Count a finished request and let flow control learn from it (and the peer's deadlines: the time
        an answered request took, or that it timed out)."""
        self._flow.record(call.peer, call.outcome, call.refusal, started=call.started)
        timed = getattr(call.task, "timed", None)  # the kind of request whose deadline follows the link
        if timed is not None and call.outcome == "timeout":
            self._flow.deadlines.timed_out(call.peer, timed)
        elif timed is not None and call.outcome == "ok":
            took = getattr(call.task, "took_s", None)
            self._flow.deadlines.sample(call.peer, timed, took if took is not None else call.latency_s or 0.0)
        for peer in getattr(call.task, "busy_peers", ()):  # peers skipped on the way: each answered busy
            self._flow.heard(peer)
        busy = getattr(call.task, "busy", 0)
        if busy:
            self._counters.add("busy_answers", busy)
        if call.outcome == "ok":
            self._counters.add("fetches_ok")
            self._counters.set("last_fetch_latency_s", call.latency_s)
            self._counters.set(f"peer.{call.peer}.latency_s", call.latency_s)
            retries = getattr(call.task, "retries", 0)
            if retries:
                self._counters.add("same_host_retries", retries)
            return
        if call.outcome == "refused" and call.refusal in _QUIET:
            self._counters.add(f"fetches_{call.refusal}")
            return
        self._counters.add(_FAILURE_COUNTERS.get(call.outcome, "fetches_failed"))
        if call.outcome in ("cancelled", "expired"):
            return
        self._counters.add(f"peer.{call.peer}.failures")
        act = "fetch from" if isinstance(call.task, FetchTask) else "exchange with"
        self._log(
            30, (call.peer, call.outcome), "%s: %s %s %s: %s", self._name, act, call.peer, call.outcome, call.reason
        )

    def timed_out(self, peer: str) -> None:
        """The training thread gave up waiting for a fetch from `peer` (mode pull: it never finished in time)."""
        self._flow.record(peer, "timeout")
        self._flow.deadlines.timed_out(peer, FetchTask.timed)
        self._counters.add("fetches_timed_out")
