"""A worker's side of the master's calls: one Lazy-Pirate channel, used from the worker's thread only.

Every call waits at most ``timeout_s`` for a reply, and a call that got none
is sent again (on a fresh socket) until ``unreachable_s`` passed, then raises
:class:`MasterUnreachable`. Resending is safe: gradient reports carry a
sequence number and a resent ``done`` is recognized, so the master never
counts one twice (see :mod:`.master`). A refusal from the master raises
:class:`~.master.Refusal` with the master's reason, except ``busy`` (the
master's ZeroMQ still holds earlier replies to this worker), which is asked
again after a pause of 1 ms doubling to 50 ms, within ``unreachable_s``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import zmq

from dpwa.backoff import Backoff
from dpwa.wire.calls import Response
from dpwa.wire.channel import Channel
from dpwa.wire.errors import ProtocolError, TransportError
from dpwa.wire.schema import MessageKind, encode

from ..layout import ModelLayout
from . import protocol as m
from .master import Accepted, Assignment, NoMoreTask, Refusal, Segment, Wait

__all__ = ["MasterClient", "MasterUnreachable"]


BUSY_PAUSE_MAX_S = 0.05  # the longest pause before asking again after a busy refusal


class MasterUnreachable(TransportError):
    """The master did not answer for longer than the client's ``unreachable_s``."""


class MasterClient:
    """Calls a sync master on behalf of one worker.

    Args:
        endpoint: the master's endpoint.
        name: this worker's name (the master's ``from``; with CURVE, the name its key stands for).
        layout: the model's layout (its fingerprint goes with every call; sizes are checked).
        context: the ZeroMQ context (default: a private one, terminated by close()).
        socket_options: extra socket options (CURVE keys: ``Curve.client_options(master_key)``).
        timeout_s: how long one attempt waits for a reply.
        unreachable_s: how long a call keeps trying before it raises MasterUnreachable.
    """

    def __init__(
        self,
        endpoint: str,
        name: str,
        layout: ModelLayout,
        *,
        context: zmq.Context | None = None,
        socket_options: Mapping[int, Any] | None = None,
        timeout_s: float = 2.0,
        unreachable_s: float = 30.0,
    ) -> None:
        if timeout_s <= 0 or unreachable_s < timeout_s:
            raise ValueError(f"need 0 < timeout_s <= unreachable_s, got {timeout_s} and {unreachable_s}")
        self.name = name
        self.layout = layout
        self._fp = layout.fingerprint
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        largest = 4 * max(layout.param_size, layout.buffer_size, 1) + (1 << 16)
        self._channel = Channel(
            self._ctx,
            endpoint,
            name=f"{name} -> master",
            max_reply_bytes=largest,
            socket_options=socket_options,
        )
        self.timeout_s = timeout_s
        self.unreachable_s = unreachable_s
        self.bytes_sent = 0  # tensor bytes (payload frames), as every system counts them
        self.bytes_received = 0
        self.resent = 0  # requests sent again after no reply
        self.busy_retries = 0  # requests asked again after a busy refusal (unsent replies not yet released)

    def close(self) -> None:
        """Close the channel's socket (linger 0) and a private context. Idempotent."""
        self._channel.close()
        if self._own_context and not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- transport

    def _request(
        self, make_frames: Callable[[int], Sequence[Any]], accept: Mapping[str, MessageKind], what: str
    ) -> Response:
        start = time.monotonic()
        busy = Backoff(0.001, BUSY_PAUSE_MAX_S)  # the pause after each busy refusal of this request
        while True:
            request_id = secrets.randbits(64)
            frames = make_frames(request_id)
            try:
                response = self._channel.request(frames, request_id, time.monotonic() + self.timeout_s, accept=accept)
            except TransportError as exc:  # no reply in time, or cannot send: try again on a fresh socket
                self._channel.reset()
                if time.monotonic() - start + self.timeout_s > self.unreachable_s:
                    raise MasterUnreachable(
                        f"{self.name}: no answer from the master at {self._channel.endpoint} to {what} "
                        f"for {time.monotonic() - start:.1f} s: {exc}"
                    ) from exc
                self.resent += 1
                continue
            self.bytes_sent += sum(memoryview(f).nbytes for f in frames[1:])  # tensor frames, not headers
            self.bytes_received += sum(len(f) for f in response.frames)
            if response.header.kind == "error" and response.header["reason"] == "busy":
                # The master's ZeroMQ still holds our earlier replies (it learns of their release from pyzmq's
                # garbage-collector thread, which lags on a loaded machine): ask again soon, as long as the
                # master answers at all. Nothing was done for this request.
                if time.monotonic() - start > self.unreachable_s:
                    raise Refusal(response.header["reason"], response.header["detail"])
                self.busy_retries += 1
                time.sleep(busy.next())  # a bounded back-off, not a wait
                continue
            if response.header.kind == "error":
                raise Refusal(response.header["reason"], response.header["detail"])
            return response

    # ----------------------------------------------------------------- the calls

    def get_task(self) -> Assignment | Wait | NoMoreTask:
        reply = self._request(
            lambda rid: [encode(m.GET_TASK, rid, **{"from": self.name, "fp": self._fp})], m.TASK_REPLIES, "GetTask"
        )
        h = reply.header
        if h.kind == m.TASK.name:
            return Assignment(Segment(h["task"], h["epoch"], h["segment"]), h["token"], h["version"])
        if h.kind == m.WAIT.name:
            return Wait(h["retry_ms"] / 1000)
        return NoMoreTask()

    def update_model(self, version: int) -> tuple[int, np.ndarray, np.ndarray] | None:
        """The model if `version` is old (-1: none held): (its version, parameters, buffers); None if current."""
        reply = self._request(
            lambda rid: [encode(m.UPDATE_MODEL, rid, **{"from": self.name, "fp": self._fp, "version": version})],
            m.MODEL_REPLIES,
            "UpdateModelIfOutOfDate",
        )
        h = reply.header
        if h.kind == m.UP_TO_DATE.name:
            if h["version"] != version:
                raise ProtocolError("bad_reply", f"up to date at version {h['version']}, but we hold {version}")
            return None
        params_frame, buffers_frame = reply.frames
        expected = (4 * self.layout.param_size, 4 * self.layout.buffer_size)
        if (len(params_frame), len(buffers_frame)) != expected or (h["params_bytes"], h["buffers_bytes"]) != expected:
            raise ProtocolError(
                "bad_size", f"a model of {len(params_frame)} + {len(buffers_frame)} bytes, expected {expected}"
            )
        if h["version"] < version:
            raise ProtocolError("bad_reply", f"the master sent version {h['version']}, older than ours ({version})")
        params = np.frombuffer(params_frame.buffer, np.float32)
        buffers = np.frombuffer(buffers_frame.buffer, np.float32)
        return h["version"], params, buffers

    def report_gradients(
        self,
        task: Assignment,
        seq: int,
        version: int,
        batch: int,
        grads: np.ndarray,
        deltas: np.ndarray,
    ) -> Accepted:
        """ReportGradients; raises Refusal (``stale_version``, ``not_held``, ...) when the master refuses."""
        if grads.shape != (self.layout.param_size,) or deltas.shape != (self.layout.buffer_size,):
            raise ValueError(f"gradients of shape {grads.shape} and deltas of {deltas.shape} do not fit the layout")
        fields = {
            "from": self.name,
            "fp": self._fp,
            "task": task.task.id,
            "token": task.token,
            "seq": seq,
            "version": version,
            "batch": batch,
        }
        reply = self._request(
            lambda rid: [encode(m.REPORT_GRADIENTS, rid, **fields), grads, deltas],
            {m.ACCEPTED.name: m.ACCEPTED},
            "ReportGradients",
        )
        h = reply.header
        return Accepted(h["version"], h["stepped"], h["duplicate"])

    def report_task(self, task: Assignment, status: str) -> bool:
        """ReportTask(task, done | failed); True if this completed training."""
        fields = {"from": self.name, "fp": self._fp, "task": task.task.id, "token": task.token, "status": status}
        reply = self._request(
            lambda rid: [encode(m.REPORT_TASK, rid, **fields)], {m.TASK_RECORDED.name: m.TASK_RECORDED}, "ReportTask"
        )
        return bool(reply.header["complete"])

    def status(self) -> dict[str, Any]:
        reply = self._request(
            lambda rid: [encode(m.STATUS, rid, **{"from": self.name})], {m.STATUS_REPLY.name: m.STATUS_REPLY}, "status"
        )
        return dict(reply.header.fields)
