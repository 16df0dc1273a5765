"""The requesting half of the transport: Lazy-Pirate channels, run by one client thread.

* :class:`Channel` is the "Lazy Pirate" client of the ZeroMQ guide: a REQ
  socket to one endpoint, polled with a deadline. After a timeout it is
  closed with linger 0 and replaced, because a REQ socket whose reply was
  lost can never send again, and a late reply must never be taken for the
  next one. Every reply's request id is checked, and nothing is sent once
  the deadline has passed.

* :class:`ClientThread` owns every channel and runs :class:`Task` s one at a
  time. A task is one conversation with one peer (a fetch; an exchange and
  its confirm; a barrier poll): its ``run(ask)`` sends requests through
  ``ask`` and returns a value, or raises. The submitter gets a :class:`Call`
  and reads its outcome once ``done`` is set. The thread never touches the
  submitter's state: results travel back in the call, so the submitter's
  state keeps one owner. Outcomes:

  * ``ok``: ``run`` returned; ``call.value`` holds what it returned;
  * ``timeout``: no reply by the deadline (the socket was replaced);
  * ``refused``: the peer answered ``error`` (busy, not ready, ...);
  * ``rejected``: the reply broke the protocol or failed validation;
  * ``failed``: the transport failed otherwise (cannot connect, cannot send);
  * ``expired``: the deadline passed before anything was sent (not the peer's fault);
  * ``cancelled``: the submitter gave up first, or the thread is closing.

* :class:`DirectClient` runs tasks that can name their first request
  (:class:`FirstRequest`) on the caller's own thread instead: the request
  goes out at ``start``, ZeroMQ's I/O thread receives the reply meanwhile,
  and the call's ``wait`` runs the rest of the task, with the same outcomes.

Nothing a peer sends can raise out of these threads.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from ..logs import logger
from .messages import KINDS, MAX_HEADER_BYTES, Header, MessageKind, ProtocolError, decode
from .payload import CHUNK_BYTES, Payload, group, send_frames
from .server import FRAME_ALLOWANCE, POLL_SLICE_S, Refused, TransportError, base_options

__all__ = [
    "OUTCOMES",
    "Ask",
    "Call",
    "Channel",
    "ClientThread",
    "DeadlinePassed",
    "DirectCall",
    "DirectClient",
    "FirstRequest",
    "RequestCancelled",
    "RequestTimeout",
    "Response",
    "Task",
    "release",
]

OUTCOMES = ("ok", "timeout", "refused", "rejected", "failed", "expired", "cancelled")


class RequestTimeout(TransportError):
    """No reply came before the deadline."""


class RequestCancelled(TransportError):
    """The caller gave up on the request before it completed."""


class DeadlinePassed(TransportError):
    """The deadline passed before the request was sent; nothing went out."""


@dataclass
class Response:
    """A reply: its validated header and its payloads (as many as its kind declares)."""

    header: Header
    frames: list[Payload]


class Channel:
    """A Lazy-Pirate REQ client for one endpoint. Use it from one thread only.

    Args:
        context: the ZeroMQ context to create sockets from.
        endpoint: the server to talk to.
        name: used in error messages ("w1 -> w2").
        max_reply_bytes: the largest frame accepted; ZeroMQ drops a connection
            that sends more, before allocating it.
        socket_options: extra options set on every new socket (CURVE keys, say).
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        *,
        name: str = "dpwa",
        max_reply_bytes: int = MAX_HEADER_BYTES,
        socket_options: Mapping[int, Any] | None = None,
        heartbeat_ms: int = 1000,
    ) -> None:
        self._ctx = context
        self.endpoint = endpoint
        self.name = name
        self._max_reply_bytes = max_reply_bytes
        self._socket_options = dict(socket_options or {})
        self._heartbeat_ms = heartbeat_ms
        self._sock: zmq.Socket | None = None

    def request(
        self,
        frames: Sequence[Any],
        request_id: int,
        deadline: float,
        *,
        accept: Mapping[str, MessageKind] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Response:
        """Send `frames` and wait until `deadline` for the reply with the same request id.

        `deadline` is a ``time.monotonic()`` value; nothing is sent once it has
        passed (DeadlinePassed). `accept` names the reply kinds expected
        (``error`` always is). Raises RequestTimeout, RequestCancelled,
        DeadlinePassed, ProtocolError (a malformed or unexpected reply) or
        TransportError.
        """
        self.send(frames, request_id, deadline)
        return self.receive(request_id, deadline, accept=accept, cancelled=cancelled)

    def send(self, frames: Sequence[Any], request_id: int, deadline: float) -> None:
        """The first half of :meth:`request`: send `frames` (a request whose id is `request_id`) at once."""
        if time.monotonic() >= deadline:
            raise DeadlinePassed(f"{self.name}: the deadline passed before request {request_id} was sent")
        sock = self._socket()
        try:
            send_frames(sock, frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.reset()
            raise TransportError(f"{self.name}: cannot send to {self.endpoint}: {exc}") from exc

    def receive(
        self,
        request_id: int,
        deadline: float,
        *,
        accept: Mapping[str, MessageKind] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Response:
        """The second half of :meth:`request`: the reply to the request just sent, waiting until `deadline`.

        A reply that has already arrived is taken even when the deadline has passed (it came in time).
        """
        sock = self._sock
        if sock is None:
            raise TransportError(f"{self.name}: no request to {self.endpoint} is waiting for its reply")
        ready = sock.poll(0)
        while not ready:
            if cancelled():
                self.reset()
                raise RequestCancelled(f"{self.name}: request {request_id} to {self.endpoint} cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.reset()
                raise RequestTimeout(f"{self.name}: no reply from {self.endpoint} for request {request_id}")
            ready = sock.poll(max(1, int(min(remaining, POLL_SLICE_S) * 1000)))
        try:
            reply = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            self.reset()
            raise TransportError(f"{self.name}: receive from {self.endpoint} failed: {exc}") from exc
        if not reply:
            raise ProtocolError("bad_reply", f"from {self.endpoint}: an empty message")
        try:
            header = decode(reply[0].buffer, accept)
        except ProtocolError as exc:
            raise ProtocolError(exc.reason, f"from {self.endpoint}: {exc.detail}") from None
        if header.id != request_id and not (header.kind == "error" and header.id == 0):
            self.reset()
            raise ProtocolError("bad_id", f"from {self.endpoint}: reply to request {header.id}, expected {request_id}")
        try:
            payloads = group(reply[1:], KINDS[header.kind].payload)
        except ProtocolError as exc:
            raise ProtocolError("bad_reply", f"from {self.endpoint}: a {header.kind} reply: {exc.detail}") from None
        return Response(header, payloads)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            try:
                base_options(sock, self._heartbeat_ms)
                # every frame is a header or one chunk of a payload (dpwa.wire.payload)
                sock.setsockopt(zmq.MAXMSGSIZE, min(self._max_reply_bytes, CHUNK_BYTES) + FRAME_ALLOWANCE)
                sock.setsockopt(zmq.RECONNECT_IVL, 100)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
                if "[" in self.endpoint:
                    sock.setsockopt(zmq.IPV6, 1)
                for option, value in self._socket_options.items():
                    sock.setsockopt(option, value)
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise TransportError(f"{self.name}: cannot connect to {self.endpoint}: {exc}") from exc
            self._sock = sock
        return self._sock

    def reset(self) -> None:
        """Discard the socket (linger 0); the next request opens a fresh one."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self.reset()


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
        self.outcome = ""
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

    def finish(self, outcome: str, reason: str = "", value: Any = None, refusal: str = "") -> None:
        with self._lock:
            keep = not self._cancelled
            self.outcome, self.reason, self.refusal = outcome, reason, refusal
            self._value = value if keep else None
            self.latency_s = time.monotonic() - self.started
        if not keep:
            release(value)
        self.done.set()


class _Discard:
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


class ClientThread:
    """Runs :class:`Task` s one at a time on its own thread, which owns every channel.

    Args:
        context: the ZeroMQ context for the channels.
        endpoints: peer name -> endpoint to connect to.
        name: the owner's name, for logs and the thread name.
        max_reply_bytes: the largest reply frame accepted.
        socket_options: peer name -> options for its sockets (CURVE keys, say).
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoints: Mapping[str, str],
        *,
        name: str,
        max_reply_bytes: int,
        socket_options: Mapping[str, Mapping[int, Any]] | None = None,
    ) -> None:
        self._ctx = context
        self._endpoints = dict(endpoints)
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
        channels = _Channels(self._ctx, self._endpoints, self.name, self._max_reply_bytes, self._socket_options)
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
            request_id = secrets.randbits(64)
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
        endpoints: Mapping[str, str],
        name: str,
        max_reply_bytes: int,
        socket_options: Mapping[str, Mapping[int, Any]],
    ) -> None:
        self._ctx, self.endpoints, self.name = context, endpoints, name
        self._max_reply_bytes, self._socket_options = max_reply_bytes, socket_options
        self._channels: dict[str, Channel] = {}

    def get(self, peer: str) -> Channel:
        channel = self._channels.get(peer)
        if channel is None:
            if peer not in self.endpoints:
                raise TransportError(f"{self.name}: unknown peer {peer!r}")
            channel = self._channels[peer] = Channel(
                self._ctx,
                self.endpoints[peer],
                name=f"{self.name} -> {peer}",
                max_reply_bytes=self._max_reply_bytes,
                socket_options=self._socket_options.get(peer),
            )
        return channel

    def drop(self, peer: str) -> None:
        channel = self._channels.pop(peer, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for peer in list(self._channels):
            self.drop(peer)


@dataclass
class _Sent:
    """A task's first request, already sent by a DirectClient."""

    channel: Channel
    request_id: int
    accept: Mapping[str, MessageKind]


class FirstRequest(Task, Protocol):
    """A task that can say what its first request is before it runs, so it can be sent early."""

    def first_request(self, request_id: int) -> tuple[Sequence[Any], Mapping[str, MessageKind]]:
        """The frames and accepted reply kinds of the first request ``run`` makes."""


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
    ) -> None:
        self._channels = _Channels(context, dict(endpoints), name, max_reply_bytes, dict(socket_options or {}))
        self._waiting: dict[str, DirectCall] = {}  # peer -> the call whose reply its channel waits for

    def start(self, task: FirstRequest) -> DirectCall:
        """Send `task`'s first request now; the rest runs when the returned call is waited for."""
        earlier = self._waiting.get(task.peer)
        if earlier is not None:  # its reply was never taken: a REQ socket must be replaced before it sends again
            earlier.abandon()
        sent = None
        call = DirectCall(task, self, None)
        try:
            channel = self._channels.get(task.peer)
            request_id = secrets.randbits(64)
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

    def _discard(self, call: DirectCall) -> None:
        """`call` will not be waited for: drop the request in flight with its socket."""
        if self._waiting.get(call.task.peer) is call:
            del self._waiting[call.task.peer]
            if call._sent is not None:
                call._sent.channel.reset()
                call._sent = None
            call.finish("cancelled", "abandoned before its reply was taken")

    def close(self) -> None:
        for call in list(self._waiting.values()):
            call.abandon()
        self._channels.close()
