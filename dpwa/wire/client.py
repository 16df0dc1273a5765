"""The clients: threads (or the caller's own thread) that run tasks on request channels.

* :class:`ClientThread` owns every channel and runs tasks (:mod:`dpwa.wire.calls`)
  one at a time. A task is one conversation with one peer (a fetch; an exchange
  and its confirm; a barrier poll).

* :class:`DirectClient` runs tasks that can name their first request
  (:class:`~dpwa.wire.calls.FirstRequest`) on the caller's own thread instead:
  the request goes out at ``start``, ZeroMQ's I/O thread receives the reply
  meanwhile, and the call's ``wait`` runs the rest of the task, with the same
  outcomes.

Nothing a peer sends can raise out of these threads.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from ..logs import logger
from .calls import Call, FirstRequest, Response, Task
from .channel import Channel
from .errors import DeadlinePassed, ProtocolError, Refused, RequestCancelled, RequestTimeout, TransportError
from .schema import MessageKind
from .sockets import POLL_SLICE_S

__all__ = ["ClientThread", "DirectCall", "DirectClient", "PeerBook"]


class PeerBook(Mapping[str, str]):
    """Peer name -> endpoint, shared by a node's clients: thread-safe, and changed while they run.

    A plain mapping given to a client is copied into one. An owner that learns of peers as they come
    and go (open membership, :mod:`dpwa.gossip.membership.members`) changes it with :meth:`put` and :meth:`drop`;
    a client's channel to a peer whose endpoint changed is replaced at its next request, and its channels
    to peers dropped meanwhile are closed then (each client sweeps them in its own thread, which owns them;
    :attr:`generation` tells it that something changed).
    """

    def __init__(self, endpoints: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, str] = dict(endpoints or {})
        self._options: dict[str, Mapping[int, Any]] = {}  # peer -> its sockets' options, where put() gave them
        self._generation = 0  # changes each time a peer is dropped or moves

    @property
    def generation(self) -> int:
        """A number that changes whenever a peer is dropped or its endpoint changes."""
        with self._lock:
            return self._generation

    def __getitem__(self, peer: str) -> str:
        with self._lock:
            return self._endpoints[peer]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._endpoints))

    def __len__(self) -> int:
        with self._lock:
            return len(self._endpoints)

    def __contains__(self, peer: object) -> bool:
        with self._lock:
            return peer in self._endpoints

    def get(self, peer: str, default: Any = None) -> Any:
        with self._lock:
            return self._endpoints.get(peer, default)

    def put(self, peer: str, endpoint: str, options: Mapping[int, Any] | None = None) -> None:
        """`peer` is at `endpoint`; its sockets take `options` (CURVE keys: a member learned by gossip),
        else the client's own options for it."""
        with self._lock:
            if self._endpoints.get(peer, endpoint) != endpoint:
                self._generation += 1
            self._endpoints[peer] = endpoint
            if options is None:
                self._options.pop(peer, None)
            else:
                self._options[peer] = dict(options)

    def drop(self, peer: str) -> None:
        with self._lock:
            if self._endpoints.pop(peer, None) is not None:
                self._generation += 1
            self._options.pop(peer, None)

    def options(self, peer: str) -> Mapping[int, Any] | None:
        """The socket options put() gave `peer`, if any."""
        with self._lock:
            return self._options.get(peer)


def _book(endpoints: Mapping[str, str]) -> PeerBook:
    return endpoints if isinstance(endpoints, PeerBook) else PeerBook(endpoints)


class _Discard:
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


class ClientThread:
    """Runs :class:`Task` s one at a time on its own thread, which owns every channel.

    Args:
        context: the ZeroMQ context for the channels.
        endpoints: peer name -> endpoint to connect to (a :class:`PeerBook` is used as it is, and may change).
        name: the owner's name, for logs and the thread name.
        max_reply_bytes: the largest reply frame accepted.
        socket_options: peer name -> options for its sockets (CURVE keys, say).
        heard: called (on this thread) with a peer whenever any reply of it arrives, a late one included.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoints: Mapping[str, str],
        *,
        name: str,
        max_reply_bytes: int,
        socket_options: Mapping[str, Mapping[int, Any]] | None = None,
        heard: Callable[[str], None] | None = None,
    ) -> None:
        self._heard = heard
        self._ctx = context
        self._endpoints = _book(endpoints)
        self.name = name
        self._max_reply_bytes = max_reply_bytes
        self._socket_options = dict(socket_options or {})
        self._queue: queue.Queue[Call | _Discard] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dpwa-tx-{name}", daemon=True)

    def start(self) -> ClientThread:
        self._thread.start()
        return self

    def submit(self, task: Task) -> Call:
        call = Call(task)
        if self._stop.is_set():
            call.finish("cancelled", "the client is closing")
        else:
            self._queue.put(call)
        return call

    def discard(self, obj: Any) -> None:
        """Drop `obj` (a received frame, say) on the client thread.

        Freeing a large ZeroMQ message unmaps its memory, which takes
        milliseconds; this keeps that cost off the caller's thread.
        """
        if not self._stop.is_set():
            self._queue.put(_Discard(obj))

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread, cancel queued calls, close every channel. True if it ended in time."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("%s: Tx thread still running %.1f s after close(); it is a daemon", self.name, timeout_s)
            return False
        self._cancel_queued()
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Call):
                item.finish("cancelled", "the client is closing")

    def _run(self) -> None:
        channels = _Channels(
            self._ctx, self._endpoints, self.name, self._max_reply_bytes, self._socket_options, self._heard
        )
        try:
            while not self._stop.is_set():
                try:
                    item = self._queue.get(timeout=POLL_SLICE_S)
                except queue.Empty:
                    continue
                if isinstance(item, _Discard):
                    del item  # the last reference: the memory is freed here
                    continue
                self._execute(item, channels)
        except Exception:
            logger.exception("%s: Tx thread failed", self.name)
        finally:
            channels.close()
            self._cancel_queued()

    def _execute(self, call: Call, channels: _Channels) -> None:
        task = call.task
        if call.cancelled:
            call.finish("cancelled", "cancelled before it was sent")
            return
        if task.peer not in self._endpoints:
            call.finish("failed", f"unknown peer {task.peer!r}")
            return
        if time.monotonic() >= task.deadline:
            call.finish("expired", "the deadline passed while it waited its turn")
            return
        _run(call, channels, lambda: call.cancelled or self._stop.is_set())  # an abandoned call stops at once


def _run(call: Call, channels: _Channels, cancelled: Callable[[], bool], sent: _Sent | None = None) -> None:
    """Run `call`'s task through `channels` and finish the call with its outcome; nothing raises out.

    `sent`: its first request is already out (DirectClient); the task's first ask receives its reply.
    """
    task = call.task

    def ask(
        make_frames: Callable[[int], Sequence[Any]],
        accept: Mapping[str, MessageKind],
        deadline: float | None = None,
    ) -> Response:
        nonlocal sent
        end = task.deadline if deadline is None else min(deadline, task.deadline)
        if sent is not None:
            first, sent = sent, None
            response = first.channel.receive(first.request_id, end, accept=first.accept, cancelled=cancelled)
        else:
            channel = channels.get(task.peer)  # a task may move on to another peer between requests
            request_id = channels.next_id()
            response = channel.request(make_frames(request_id), request_id, end, accept=accept, cancelled=cancelled)
        if response.header.kind == "error":
            raise Refused(response.header["reason"], response.header["detail"])
        return response

    try:
        value = task.run(ask)
    except Refused as exc:
        call.finish("refused", f"{exc.reason}: {exc.detail}", refusal=exc.reason)
    except ProtocolError as exc:
        call.finish("rejected", str(exc))
    except RequestTimeout:
        call.finish("timeout", f"no reply within the deadline from {channels.endpoints.get(task.peer)}")
    except DeadlinePassed as exc:
        call.finish("expired", str(exc))
    except RequestCancelled:
        call.finish("cancelled", "cancelled while waiting for the reply")
    except TransportError as exc:
        call.finish("failed", str(exc))
    except Exception as exc:  # a bug in a task must fail that task, not the thread
        logger.exception("%s: a task for %s failed", channels.name, task.peer)
        channels.drop(task.peer)
        call.finish("failed", f"internal error: {type(exc).__name__}: {exc}")
    else:
        call.finish("ok", value=value)


class _Channels:
    """One owner thread's channels, one per peer, made on first use."""

    def __init__(
        self,
        context: zmq.Context,
        endpoints: PeerBook,
        name: str,
        max_reply_bytes: int,
        socket_options: Mapping[str, Mapping[int, Any]],
        heard: Callable[[str], None] | None = None,
        dropped: Callable[[str], None] | None = None,
    ) -> None:
        self._ctx, self.endpoints, self.name, self._heard = context, endpoints, name, heard
        self._dropped = dropped  # told of each peer whose channel closes, before it closes
        self._max_reply_bytes, self._socket_options = max_reply_bytes, socket_options
        self._channels: dict[str, Channel] = {}
        self._last_id = secrets.randbits(64)  # request ids count on from a random start: none repeats
        self._swept = endpoints.generation  # the book's generation when channels were last matched to it

    def next_id(self) -> int:
        """A request id for this thread's next request: never 0 (the id of an error that answers none)."""
        self._last_id = (self._last_id + 1) & 0xFFFF_FFFF_FFFF_FFFF or 1
        return self._last_id

    def get(self, peer: str) -> Channel:
        self._sweep()
        channel = self._channels.get(peer)
        endpoint = self.endpoints.get(peer)
        if channel is not None and channel.endpoint != endpoint:  # the peer is gone, or came back elsewhere
            self.drop(peer)
            channel = None
        if channel is None:
            if endpoint is None:
                raise TransportError(f"{self.name}: unknown peer {peer!r}")
            heard = self._heard
            channel = self._channels[peer] = Channel(
                self._ctx,
                endpoint,
                name=f"{self.name} -> {peer}",
                max_reply_bytes=self._max_reply_bytes,
                socket_options=self.endpoints.options(peer) or self._socket_options.get(peer),
                heard=(lambda: heard(peer)) if heard is not None else lambda: None,
            )
        return channel

    def drop(self, peer: str) -> None:
        channel = self._channels.pop(peer, None)
        if channel is not None:
            if self._dropped is not None:
                self._dropped(peer)
            channel.close()

    def _sweep(self) -> None:
        """Close the channels of peers the book dropped (or moved) since the last sweep: a member removed
        from the view (open membership) leaves no socket behind, however many come and go."""
        generation = self.endpoints.generation
        if generation == self._swept:
            return
        self._swept = generation
        for peer, channel in list(self._channels.items()):
            if self.endpoints.get(peer) != channel.endpoint:
                self.drop(peer)

    def __len__(self) -> int:
        return len(self._channels)

    def close(self) -> None:
        for peer in list(self._channels):
            self.drop(peer)


@dataclass
class _Sent:
    """A task's first request, already sent by a DirectClient."""

    channel: Channel
    request_id: int
    accept: Mapping[str, MessageKind]


class DirectCall(Call):
    """A call run by a :class:`DirectClient`: the rest of its task runs in :meth:`wait`."""

    def __init__(self, task: FirstRequest, client: DirectClient, sent: _Sent | None) -> None:
        super().__init__(task)
        self._client, self._sent = client, sent

    def wait(self, timeout_s: float | None) -> bool:
        """Receive the reply and finish the task, on this thread, until its deadline (or `timeout_s`, if sooner)."""
        if not self.done.is_set():
            self._client._complete(self, timeout_s)
        return True

    def abandon(self) -> None:
        if not self.done.is_set():
            self._client._discard(self)
        super().abandon()


class DirectClient:
    """Runs tasks on the caller's own thread, in two halves, without a hand-off to another thread.

    :meth:`start` sends the task's first request at once; ZeroMQ's I/O thread
    receives the reply in the background while the caller works; the call's
    ``wait`` takes the reply and runs the rest of the task (checks, any
    further requests) on the caller's thread, with the outcomes and deadlines
    of :class:`ClientThread`. That saves two thread wake-ups per request,
    which on a busy machine cost more than a small model's whole transfer.
    Owns its channels: use it from one thread only, and close it from there.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoints: Mapping[str, str],
        *,
        name: str,
        max_reply_bytes: int,
        socket_options: Mapping[str, Mapping[int, Any]] | None = None,
        heard: Callable[[str], None] | None = None,
    ) -> None:
        self._waiting: dict[str, DirectCall] = {}  # peer -> the call whose reply its channel waits for
        self._channels = _Channels(
            context, _book(endpoints), name, max_reply_bytes, dict(socket_options or {}), heard, self._let_go_of
        )

    def start(self, task: FirstRequest) -> DirectCall:
        """Send `task`'s first request now; the rest runs when the returned call is waited for."""
        earlier = self._waiting.get(task.peer)
        if earlier is not None:  # its reply was never taken (it is dropped when it comes, as a late one)
            earlier.abandon()
        sent = None
        call = DirectCall(task, self, None)
        try:
            channel = self._channels.get(task.peer)
            request_id = self._channels.next_id()
            frames, accept = task.first_request(request_id)
            channel.send(frames, request_id, task.deadline)
            sent = _Sent(channel, request_id, accept)
        except DeadlinePassed as exc:
            call.finish("expired", str(exc))
        except TransportError as exc:
            call.finish("failed", str(exc))
        else:
            call._sent = sent
            self._waiting[task.peer] = call
        return call

    def _complete(self, call: DirectCall, timeout_s: float | None) -> None:
        if self._waiting.get(call.task.peer) is call:
            del self._waiting[call.task.peer]
        sent, call._sent = call._sent, None
        task = call.task
        if timeout_s is not None:
            task.deadline = min(task.deadline, time.monotonic() + timeout_s)
        _run(call, self._channels, lambda: call.cancelled, sent)

    def _let_go_of(self, peer: str) -> None:
        """`peer`'s channel closes (the book dropped the peer, or it moved): a call still waiting on it is let go."""
        call = self._waiting.get(peer)
        if call is not None:
            call.abandon()

    def _discard(self, call: DirectCall) -> None:
        """`call` will not be waited for: its reply is dropped when it comes (a late one)."""
        if self._waiting.get(call.task.peer) is call:
            del self._waiting[call.task.peer]
            if call._sent is not None:
                call._sent.channel.let_go(call._sent.request_id)
                call._sent = None
            call.finish("cancelled", "abandoned before its reply was taken")

    def close(self) -> None:
        for call in list(self._waiting.values()):
            call.abandon()
        self._channels.close()
