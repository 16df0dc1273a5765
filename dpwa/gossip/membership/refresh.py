"""Open membership's way back: a node asks a bootstrap address again while no member of its view is there.

Members are removed by silence (:mod:`dpwa.gossip.membership.view`), and a
removed member comes back only through news newer than what it last said.
So two parts of a cluster that stopped hearing each other for
``suspect_after_ms + dead_after_ms`` (a partition, or members too busy to
answer) remove each other for good: neither side's gossip names the other
any more, and neither asks the other anything. A bootstrap address is what
every node still knows. :class:`BootstrapRefresh` asks one again (a
``members`` request that announces this node, as at the start) whenever no
member of the view is at any of them: the node there learns of us, and its
answer brings it, and the members it names, back into our view. Both sides
then gossip again, and the rest of each side follows.

It costs nothing while a member is at a bootstrap address (the usual case).
Otherwise it asks every ``suspect_after_ms + dead_after_ms``, one request at
a time on the Tx thread (which serves no exchange meanwhile: at most
``timeout_ms`` when the address does not answer), the interval doubling while
nobody answers, up to :data:`REFRESH_MAX_S`, and back to the first interval
after an answer. It never waits: the training thread starts a request at one
step (:meth:`BootstrapRefresh.ask_if_due`) and collects it at a later one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ...backoff import Backoff
from ...config import Config, NodeSpec
from ...logs import logger
from ...wire.calls import Call
from ...wire.client import PeerBook
from .members import Members, MembersTask

__all__ = ["REFRESH_MAX_S", "BootstrapRefresh"]

REFRESH_MAX_S = 300.0  # a bootstrap address that never answers is asked at most this rarely
_COLLECT_SLACK_S = 0.5  # beyond the request's deadline, before a call that never finished is abandoned


class BootstrapRefresh:
    """(The training thread) Ask a bootstrap address again while no member of the view is at one.

    :meth:`close` may come from another thread (a node closed from elsewhere): a lock orders it with
    :meth:`ask_if_due`.

    Args:
        name: this node.
        config: the cluster (``bootstrap:``, ``suspect_after_ms``, ``dead_after_ms``, ``timeout_ms``).
        members: this node's view.
        book: the clients' address book (a bootstrap address is in it only while it is asked).
        submit: the Tx thread's queue.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        name: str,
        config: Config,
        members: Members,
        book: PeerBook,
        submit: Callable[[Any], Call],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._specs = config.bootstrap_for(name)
        self._config, self._members, self._book, self._submit, self._clock = config, members, book, submit, clock
        self.first_interval_s = (config.suspect_after_ms + config.dead_after_ms) / 1000.0
        # the pause after n >= 1 unanswered asks in a row: the first interval times 2**n, up to REFRESH_MAX_S
        self._backoff = Backoff(min(2 * self.first_interval_s, REFRESH_MAX_S), REFRESH_MAX_S)
        self._next = clock() + self.first_interval_s
        self._turn = 0  # which missing address is asked next (in turn)
        self._asking: tuple[NodeSpec, Call, float] | None = None  # the address asked, its call, its deadline
        self.asked = 0
        self.answered = 0
        self._lock = threading.Lock()
        self._closed = False

    @property
    def interval_s(self) -> float:
        """The next pause: the first interval, doubled by each unanswered ask in a row, up to REFRESH_MAX_S."""
        failures = self._backoff.failures
        return self._backoff.after(failures) if failures else self.first_interval_s

    def ask_if_due(self) -> None:
        """Between steps: collect the request in flight, or start one when it is time and it is needed."""
        with self._lock:
            if not self._closed:
                self._ask_if_due()

    def _ask_if_due(self) -> None:
        if self._asking is not None:
            self._collect()
            return
        now = self._clock()
        if not self._specs or now < self._next:
            return
        present = {(spec.host.lower(), spec.port) for spec in self._members.peers().values()}
        missing = [spec for spec in self._specs if (spec.host.lower(), spec.port) not in present]
        if not missing:  # a member is at a bootstrap address: our view reaches the cluster
            self._backoff.reset()
            self._next = now + self.interval_s
            return
        spec = missing[self._turn % len(missing)]
        self._turn += 1
        self._book.put(spec.name, self._config.endpoint(spec), self._members.options_for(spec.public_key))
        me = self._members.digest()[0]  # our entry, its heartbeat raised: newer than anything said of us
        deadline = now + self._config.timeout_s
        self._asking = (spec, self._submit(MembersTask(spec.name, deadline, me)), deadline)
        self.asked += 1

    def _collect(self) -> None:
        assert self._asking is not None
        spec, call, deadline = self._asking
        now = self._clock()
        finished = call.done.is_set()  # read once: a call abandoned below may still finish meanwhile
        if not finished:
            if now < deadline + _COLLECT_SLACK_S:
                return
            call.abandon()
        self._asking = None
        self._book.drop(spec.name)
        value = call.take() if finished and call.outcome == "ok" else None
        if isinstance(value, tuple):
            digest, _ = value
            answerer = str(digest[0].get("name", "")) if digest and isinstance(digest[0], dict) else ""
            added = self._members.merge(answerer, digest)
            self.answered += 1
            self._backoff.reset()
            if added:
                logger.warning(
                    "%s: no member was at a bootstrap address; %s:%d answered, and %s came back into the view",
                    self._members.name,
                    spec.host,
                    spec.port,
                    ", ".join(added),
                )
        else:
            self._backoff.next()
        self._next = now + self.interval_s

    def close(self) -> None:
        """Abandon the request in flight, if any, and ask nothing more (idempotent)."""
        with self._lock:
            self._closed = True
            if self._asking is not None:
                spec, call, _ = self._asking
                self._asking = None
                call.abandon()
                self._book.drop(spec.name)
