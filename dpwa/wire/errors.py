"""The wire's errors: each says what went wrong between two ends, with a short reason or the endpoint at fault."""

from __future__ import annotations

from typing import Literal

__all__ = [
    "Refusal",
    "DeadlinePassed",
    "EncodeError",
    "ProtocolError",
    "Refused",
    "RequestCancelled",
    "RequestTimeout",
    "TransportError",
    "refused",
]


class ProtocolError(ValueError):
    """A message that does not follow the protocol. `reason` is a short code for counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class EncodeError(ValueError):
    """A message this side was about to send breaks its kind's schema: a bug here, never the peer's fault."""


# Why a request was refused ("not now", never "bad"): what dpwa's own services answer. A peer may send any
# short reason; these are the ones a node gives, and `refused` makes mypy check each use.
Refusal = Literal["busy", "not_ready", "closing", "aborted", "streaming", "unknown_session", "unknown_node"]


class TransportError(RuntimeError):
    """A transport operation failed; the message names the endpoint."""


class Refused(Exception):
    """A handler's ordinary refusal (busy, not ready): answered as an error, not counted as a bad request."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RequestTimeout(TransportError):
    """No reply came before the deadline."""


class RequestCancelled(TransportError):
    """The caller gave up on the request before it completed."""


class DeadlinePassed(TransportError):
    """The deadline passed before the request was sent; nothing went out."""


def refused(reason: Refusal, detail: str) -> Refused:
    """A refusal with one of the reasons dpwa's services give (checked by mypy)."""
    return Refused(reason, detail)
