"""Calls: a task (one conversation with one peer) handed to a client, and its outcome handed back.

A :class:`Task` sends its requests through an :class:`Ask` and returns a value
or raises; whoever submitted it holds a :class:`Call` and reads the outcome
once ``done`` is set. The client never touches the submitter's state: results
travel back in the call, so each piece of state keeps one owner. Outcomes
(:data:`Outcome`):

* ``ok``: ``run`` returned; the call holds what it returned;
* ``timeout``: no reply by the deadline (the socket was replaced);
* ``refused``: the peer answered ``error`` (busy, not ready, ...);
* ``rejected``: the reply broke the protocol or failed validation;
* ``failed``: the transport failed otherwise (cannot connect, cannot send);
* ``expired``: the deadline passed before anything was sent (not the peer's fault);
* ``cancelled``: the submitter gave up first, or the client is closing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from .payload import Payload
from .schema import Header, MessageKind

__all__ = ["OUTCOMES", "Ask", "Call", "FirstRequest", "Outcome", "Response", "Task", "release"]

Outcome = Literal["ok", "timeout", "refused", "rejected", "failed", "expired", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)


@dataclass
class Response:
    """A reply: its validated header and its payloads (as many as its kind declares)."""

    header: Header
    frames: list[Payload]


class Ask(Protocol):
    """How a task sends one request on its peer's channel and waits for the reply.

    ``make_frames(request_id)`` builds the request, header first. The wait ends
    at `deadline` (at most the task's). An ``error`` reply raises
    :class:`~dpwa.wire.server.Refused`; a reply of a kind not in `accept`
    raises ProtocolError.
    """

    def __call__(
        self,
        make_frames: Callable[[int], Sequence[Any]],
        accept: Mapping[str, MessageKind],
        deadline: float | None = None,
    ) -> Response: ...


class Task(Protocol):
    """One conversation with one peer, run on the client thread."""

    peer: str  # which channel `ask` uses; a task may change it between requests
    deadline: float  # time.monotonic() after which it has failed

    def run(self, ask: Ask) -> Any:
        """Talk to the peer through `ask` and return the value (owned by the call), or raise."""


def release(value: Any) -> None:
    """Let go of a value that holds memory (a received frame, a locked slot): call its ``release()``."""
    method = getattr(value, "release", None)
    if method is not None:
        method()


class Call:
    """A submitted task and, once ``done`` is set, its outcome."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.done = threading.Event()
        self.started = time.monotonic()
        self.outcome: Outcome | Literal[""] = ""  # "" until done
        self.reason = ""
        self.refusal = ""  # the peer's reason, when the outcome is "refused"
        self.latency_s: float | None = None
        self._value: Any = None
        self._cancelled = False
        self._lock = threading.Lock()

    @property
    def peer(self) -> str:
        """The peer the task talks to (a task may move on to another one while it runs)."""
        return self.task.peer

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def wait(self, timeout_s: float | None) -> bool:
        return self.done.wait(timeout_s)

    def take(self) -> Any:
        """The value, now owned by the caller."""
        with self._lock:
            value, self._value = self._value, None
        return value

    def abandon(self) -> None:
        """The submitter will not read the value: cancel the task; the value is released when it comes."""
        with self._lock:
            self._cancelled = True
            value, self._value = self._value, None
        release(value)

    def finish(self, outcome: Outcome, reason: str = "", value: Any = None, refusal: str = "") -> None:
        with self._lock:
            keep = not self._cancelled
            self.outcome, self.reason, self.refusal = outcome, reason, refusal
            self._value = value if keep else None
            self.latency_s = time.monotonic() - self.started
        if not keep:
            release(value)
        self.done.set()


class FirstRequest(Task, Protocol):
    """A task that can say what its first request is before it runs, so it can be sent early."""

    def first_request(self, request_id: int) -> tuple[Sequence[Any], Mapping[str, MessageKind]]:
        """The frames and accepted reply kinds of the first request ``run`` makes."""
