"""The Tx thread: sends one request at a time to a peer, with a deadline.

The training thread submits a :class:`Job` and later waits on ``job.done``; the
Tx thread owns every client socket (one :class:`~dpwa.transport.Requester` per
peer) and runs jobs in order. A job ends in exactly one outcome:

* ``ok``: the reply passed the job's ``validate`` and ``job.value`` holds what
  it returned (a reply rejected for a reason in ``retry_on`` is asked for
  again, with a fresh request id, while attempts and time remain);
* ``timeout``: no reply by the deadline (the socket was replaced);
* ``refused``: the peer answered with an ``error`` message (busy, not ready, ...);
* ``rejected``: the reply broke the protocol or failed validation;
* ``failed``: the transport failed otherwise (cannot connect, cannot send);
* ``cancelled``: the submitter gave up first, or the worker is closing.

Nothing a peer sends can raise out of this thread.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import zmq

from .logs import logger
from .protocol import ProtocolError
from .transport import POLL_SLICE_S, RequestCancelled, Requester, RequestTimeout, TransportError

__all__ = ["Job", "TxWorker", "OUTCOMES"]

OUTCOMES = ("ok", "timeout", "refused", "rejected", "failed", "cancelled")


@dataclass(eq=False)
class Job:
    """One request to one peer, and, once ``done`` is set, its outcome."""

    peer: str
    make_frames: Callable[[int], Sequence[Any]]  # request id -> the request, header first
    deadline: float  # time.monotonic() after which the request has failed
    # validate(header, frames, ask) checks a reply and returns job.value, or raises ProtocolError;
    # ask(make_frames) sends one more request on the same socket and returns (header, frames)
    validate: Callable[..., Any]
    retry_on: frozenset[str] = frozenset()  # ProtocolError reasons worth asking again for
    max_attempts: int = 1
    kind: str = "fetch"  # what the job is for, for whoever handles its outcome
    context: Any = None  # the submitter's data for on_done
    on_finish: Callable[["Job"], None] | None = None  # runs just before `done` is set
    done: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    outcome: str = ""
    reason: str = ""
    value: Any = None
    latency_s: float | None = None
    retries: int = 0
    request_id: int = 0  # the id of the request whose reply was accepted
    refusal: str = ""  # the peer's reason, when the outcome is "refused"
    _cancelled: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def abandon(self) -> None:
        """The submitter will not read the result: cancel the job and release its value.

        A value with a ``release()`` method (a received frame, a locked
        shared-memory slot) is released exactly once, whether it arrived
        before this call or arrives after it.
        """
        with self._lock:
            self._cancelled = True
            value, self.value = self.value, None
        _release(value)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def take(self) -> Any:
        """The value, now owned by the caller (who must release it)."""
        with self._lock:
            value, self.value = self.value, None
        return value

    def finish(self, outcome: str, reason: str = "", value: Any = None) -> None:
        """Record the outcome, run `on_finish` (so counters are current), then set `done`."""
        with self._lock:
            abandoned = self._cancelled
            self.outcome, self.reason = outcome, reason
            self.value = None if abandoned else value
            self.latency_s = time.monotonic() - self.started
        if abandoned:
            _release(value)
        if self.on_finish is not None:
            try:
                self.on_finish(self)
            except Exception:
                logger.exception("job callback failed")
        self.done.set()


def _release(value: Any) -> None:
    release = getattr(value, "release", None)
    if release is not None:
        release()


class _Discard:
    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


class TxWorker:
    """Runs :class:`Job` s one at a time on its own thread, which owns all client sockets.

    Args:
        context: ZeroMQ context for the client sockets.
        endpoints: peer name -> endpoint to connect to.
        name: this node's name, for logs and the thread name.
        on_done: called with each finished job just before its ``done`` is set (scores, counters).
        max_reply_bytes: passed to every :class:`Requester`.
        socket_options: peer name -> options for its sockets (CURVE keys, say).
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoints: Mapping[str, str],
        *,
        name: str,
        on_done: Callable[[Job], None] = lambda job: None,
        max_reply_bytes: int,
        socket_options: Mapping[str, Mapping[int, Any]] | None = None,
    ) -> None:
        self._ctx = context
        self._endpoints = dict(endpoints)
        self.name = name
        self._on_done = on_done
        self._max_reply_bytes = max_reply_bytes
        self._socket_options = dict(socket_options or {})
        self._jobs: queue.Queue[Job | _Discard] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dpwa-tx-{name}", daemon=True)

    def start(self) -> "TxWorker":
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        job.on_finish = self._on_done
        if self._stop.is_set():
            job.finish("cancelled", "the node is closing")
            return
        self._jobs.put(job)

    def discard(self, obj: Any) -> None:
        """Drop `obj` (a received frame, say) on the Tx thread.

        Freeing a large ZeroMQ message unmaps its memory, which takes
        milliseconds; this keeps that cost off the caller's thread.
        """
        if not self._stop.is_set():
            self._jobs.put(_Discard(obj))

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread, cancel queued jobs, close every socket. True if it ended in time."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("%s: Tx thread still running %.1f s after close(); it is a daemon and will die with the process",
                         self.name, timeout_s)
            return False
        self._drain()
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _drain(self) -> None:
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Job):
                item.finish("cancelled", "the node is closing")

    def _run(self) -> None:
        requesters: dict[str, Requester] = {}
        try:
            while not self._stop.is_set():
                try:
                    job = self._jobs.get(timeout=POLL_SLICE_S)
                except queue.Empty:
                    continue
                if isinstance(job, _Discard):
                    del job  # the last reference: the memory is freed here
                    continue
                try:
                    self._execute(job, requesters)
                except Exception as exc:  # a bug must fail this job, not the thread
                    logger.exception("%s: fetch from %s failed unexpectedly", self.name, job.peer)
                    stale = requesters.pop(job.peer, None)
                    if stale is not None:
                        stale.close()
                    if not job.done.is_set():
                        job.finish("failed", f"internal error: {type(exc).__name__}: {exc}")
        except Exception:
            logger.exception("%s: Tx thread failed", self.name)
        finally:
            for requester in requesters.values():
                requester.close()
            self._drain()

    def _execute(self, job: Job, requesters: dict[str, Requester]) -> None:
        if job.cancelled:
            job.finish("cancelled", "cancelled before it was sent")
            return
        endpoint = self._endpoints.get(job.peer)
        if endpoint is None:
            job.finish("failed", f"unknown peer {job.peer!r}")
            return
        requester = requesters.get(job.peer)
        if requester is None:
            requester = requesters[job.peer] = Requester(
                self._ctx, endpoint, name=f"{self.name} -> {job.peer}",
                max_reply_bytes=self._max_reply_bytes, socket_options=self._socket_options.get(job.peer),
            )
        cancelled = lambda: job.cancelled or self._stop.is_set()  # noqa: E731

        def ask(make_frames: Callable[[int], Sequence[Any]], deadline: float | None = None):
            """One more request on this socket, before `deadline` (the job's at most). A follow-up
            is not cancelled with the job: once started (a confirm, say) it runs to its end."""
            request_id = secrets.randbits(64)
            return requester.request(make_frames(request_id), request_id, min(deadline or job.deadline, job.deadline),
                                     cancelled=self._stop.is_set)

        for attempt in range(max(1, job.max_attempts)):
            request_id = secrets.randbits(64)
            try:
                header, rest = requester.request(
                    job.make_frames(request_id), request_id, job.deadline, cancelled=cancelled,
                )
                if header.kind == "error":
                    job.refusal = header["reason"]
                    job.finish("refused", f"{header['reason']}: {header['detail']}")
                    return
                job.request_id = request_id
                value = job.validate(header, rest, ask)
            except ProtocolError as exc:
                if (exc.reason in job.retry_on and attempt + 1 < job.max_attempts
                        and time.monotonic() < job.deadline):
                    job.retries += 1
                    continue
                job.finish("rejected", str(exc))
            except RequestTimeout:
                job.finish("timeout", f"no reply within the deadline from {endpoint}")
            except RequestCancelled:
                job.finish("cancelled", "cancelled while waiting for the reply")
            except TransportError as exc:
                job.finish("failed", str(exc))
            except Exception as exc:  # a bug in a validator must not kill the thread
                logger.exception("%s: validating a reply from %s failed", self.name, job.peer)
                job.finish("failed", f"validation error: {type(exc).__name__}: {exc}")
            else:
                job.finish("ok", value=value)
            return
