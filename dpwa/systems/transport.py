"""What the systems add to :mod:`dpwa.wire`: an ipc endpoint claimed for a service's lifetime."""

from __future__ import annotations

from pathlib import Path

from ..wire.endpoints import EndpointInUse, EndpointLock
from ..wire.server import TransportError

__all__ = ["IpcClaim"]


class IpcClaim:
    """An ``ipc://`` endpoint claimed by one service: locked while it runs, its socket file removed when it stops.

    libzmq silently replaces the socket file of an ipc endpoint that another
    process is serving; the lock (:class:`~dpwa.wire.endpoints.EndpointLock`)
    makes a second service on the same endpoint fail instead, as a TCP bind
    would. A TCP endpoint needs neither, and gets neither.

    Raises :class:`~dpwa.wire.server.TransportError` naming the endpoint when another process holds it.
    """

    def __init__(self, endpoint: str) -> None:
        self.path: Path | None = None
        self._lock: EndpointLock | None = None
        if endpoint.startswith("ipc://"):
            try:
                self._lock = EndpointLock(endpoint)
            except EndpointInUse as exc:
                raise TransportError(str(exc)) from None
            self.path = Path(endpoint[len("ipc://") :])

    def release(self) -> None:
        """Remove the socket file and release the lock (the lock file stays: see EndpointLock). Idempotent."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
