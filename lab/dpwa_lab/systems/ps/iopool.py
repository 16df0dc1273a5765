"""An IO thread pool for a trainer: dpwa client threads, each owning its own socket to every server.

A ZeroMQ socket must live in one thread, so a pool of T threads talking to
K servers holds T x K sockets: thread t owns its own channel to each server.
Each thread is a :class:`dpwa.wire.client.ClientThread` (tasks run one at a
time, with deadlines, Lazy-Pirate sockets); the pool gives each task to the
thread with the fewest calls still running, so a slow server holds up only
the threads talking to it. The trainer computes on its own thread, so with
T larger than the compute threads, communication never waits for compute
and compute never waits for a send.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import zmq

from dpwa.wire.calls import Call, Task
from dpwa.wire.client import ClientThread

__all__ = ["IOPool"]


class IOPool:
    """T client threads, each with its own channel to every server.

    Args:
        context: the ZeroMQ context.
        endpoints: server name -> endpoint.
        threads: how many IO threads.
        name: the owner's name (thread names, logs).
        max_reply_bytes: the largest reply frame accepted.
        socket_options: server name -> extra socket options (CURVE keys).
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoints: Mapping[str, str],
        *,
        threads: int,
        name: str,
        max_reply_bytes: int,
        socket_options: Mapping[str, Mapping[int, Any]] | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"an IO pool needs at least one thread, got {threads}")
        self._threads = [
            ClientThread(
                context,
                endpoints,
                name=f"{name}-io{i}",
                max_reply_bytes=max_reply_bytes,
                socket_options=socket_options,
            )
            for i in range(threads)
        ]
        self._running: list[list[Call]] = [[] for _ in range(threads)]

    def start(self) -> IOPool:
        for thread in self._threads:
            thread.start()
        return self

    @property
    def size(self) -> int:
        return len(self._threads)

    def submit(self, task: Task) -> Call:
        """Run `task` on the thread with the fewest calls not yet done."""
        for calls in self._running:
            calls[:] = [c for c in calls if not c.done.is_set()]
        i = min(range(len(self._threads)), key=lambda k: len(self._running[k]))
        call = self._threads[i].submit(task)
        self._running[i].append(call)
        return call

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop every thread (queued calls are cancelled) and close its sockets. True if all ended in time."""
        ended = True
        for thread in self._threads:
            ended = thread.close(timeout_s) and ended
        return ended
