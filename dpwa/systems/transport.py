"""What the systems add to :mod:`dpwa.wire` for services that each client calls several times a step.

:class:`RpcServer` is a :class:`~dpwa.wire.server.Server` that never drops
the reply to a client who has read its earlier replies. The wire server
sends each reply with ``NOBLOCK`` under a send high-water mark of 2 per
connection, which suits a gossip node (one fetch per peer per step). But
libzmq learns that a reply was read only when the server's socket processes
its pending commands, which a busy receive loop does at most about once a
millisecond. A worker that calls a master two or three times per minibatch,
while other workers keep the loop busy, then finds its connection "full"
although it read everything, and its reply is dropped (it waits out its
timeout and sends again). Asking the socket for its events before each send
processes those commands first, so only a client that really leaves replies
unread loses them.
"""

from __future__ import annotations

from typing import Any

import zmq

from ..wire.server import Reply, Server

__all__ = ["RpcServer"]


class RpcServer(Server):
    """A :class:`~dpwa.wire.server.Server` that processes libzmq's pending commands before each reply."""

    def _send(self, sock: zmq.Socket, client: bytes, reply: Reply, key: Any = None) -> None:
        sock.getsockopt(zmq.EVENTS)  # unthrottled command processing: learn which replies were read
        super()._send(sock, client, reply, key)
