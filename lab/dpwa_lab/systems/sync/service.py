"""The sync master behind dpwa's transport: a :class:`~dpwa.wire.server.Server` whose routes are the master's calls.

One thread (the server's) owns the ROUTER socket and calls the
:class:`~.master.Master`; a lock lets the owner read the status from its own
thread. Every request is checked before the master sees it: the header's
schema (by :mod:`dpwa.wire`), the sender, the model's fingerprint, and the
exact size of each payload frame; the master then checks the task, token,
sequence number, version, batch and values. Ordinary refusals
(``stale_version``, ``not_held``) are answered as ``refused``, bad requests as
``rejected``; neither changes any state.

Example::

    with MasterService(master, model, "ipc:///tmp/master", workers=["w1", "w2"]) as service:
        service.wait_complete(timeout_s=600)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import zmq

from dpwa.wire.curve import CurveKeys
from dpwa.wire.errors import ProtocolError, Refused
from dpwa.wire.schema import encode
from dpwa.wire.server import Reply, Request, Route, Server

from . import protocol as m
from .master import Assignment, BadRequest, Master, NoMoreTask, Refusal, Wait
from .model import GlobalModel

__all__ = ["MasterService"]

StepHook = Callable[[int, int, GlobalModel], None]  # (version, samples, model), called after each step


class MasterService:
    """Serves a :class:`Master` and its :class:`GlobalModel` on one endpoint.

    Args:
        master: the master's state.
        model: its model (the master's aggregator).
        endpoint: where to bind (``ipc://...`` on one machine, ``tcp://...`` with CURVE across machines).
        context: the ZeroMQ context (default: a private one, terminated by close()).
        curve: serve only the clients whose CURVE keys it lists.
        workers: without CURVE, the names a request's ``from`` may give (None: any).
        on_step: called in the server thread after every step, with the new version, the
            samples applied so far and the model (to record it; it must not block).
        name: for logs and the thread's name.
    """

    def __init__(
        self,
        master: Master,
        model: GlobalModel,
        endpoint: str,
        *,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        workers: Collection[str] | None = None,
        on_step: StepHook | None = None,
        name: str = "sync-master",
    ) -> None:
        if master.aggregator is not model:
            raise ValueError("the master must step this model (pass it as the master's aggregator)")
        self.master = master
        self.model = model
        self._fp = model.layout.fingerprint
        self._params_bytes = 4 * model.layout.param_size
        self._buffers_bytes = 4 * model.layout.buffer_size
        self._on_step = on_step
        self._lock = threading.Lock()
        self._complete = threading.Event()
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        routes = {
            m.GET_TASK.name: Route(m.GET_TASK, self._get_task),
            m.UPDATE_MODEL.name: Route(m.UPDATE_MODEL, self._update_model, bulk=True),
            m.REPORT_GRADIENTS.name: Route(
                m.REPORT_GRADIENTS, self._report_gradients, max_payload_bytes=self._params_bytes + self._buffers_bytes
            ),
            m.REPORT_TASK.name: Route(m.REPORT_TASK, self._report_task),
            m.STATUS.name: Route(m.STATUS, self._status),
        }
        allowed = 2 * (len(workers) if workers is not None else 8)
        self.server = Server(
            self._ctx, endpoint, routes, name=name, curve=curve, senders=workers, max_unsent=max(8, allowed)
        )
        self.endpoint = endpoint

    # ----------------------------------------------------------------- lifetime

    def start(self, timeout_s: float = 10.0) -> MasterService:
        try:
            self.server.start(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the server thread and close its socket (linger 0); terminate a private context. Idempotent."""
        ended = self.server.close(timeout_s)
        if self._own_context and ended:
            self._ctx.term()
        return ended

    def __enter__(self) -> MasterService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- for the owner

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self.master.status(time.monotonic())

    @property
    def complete(self) -> bool:
        return self._complete.is_set()

    def wait_complete(self, timeout_s: float) -> bool:
        """Wait until every task is done (True), or `timeout_s` passed (False)."""
        return self._complete.wait(timeout_s)

    # ----------------------------------------------------------------- handlers (the server's thread)

    def _check_fp(self, request: Request) -> None:
        fp = request.header["fp"]
        if fp != self._fp:
            raise ProtocolError(
                "bad_fingerprint", f"model layout {fp.hex()} differs from the master's {self._fp.hex()}"
            )

    @staticmethod
    def _call(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except BadRequest as exc:
            raise ProtocolError(exc.reason, exc.detail) from None
        except Refusal as exc:
            raise Refused(exc.reason, exc.detail) from None

    def _get_task(self, request: Request) -> Reply:
        self._check_fp(request)
        rid = request.header.id
        with self._lock:
            answer = self._call(lambda: self.master.get_task(request.sender, time.monotonic()))
            version = self.master.version
        if isinstance(answer, Assignment):
            task = answer.task
            return Reply(
                encode(
                    m.TASK,
                    rid,
                    task=task.id,
                    epoch=task.epoch,
                    segment=task.segment,
                    token=answer.token,
                    version=answer.version,
                )
            )
        if isinstance(answer, Wait):
            return Reply(encode(m.WAIT, rid, retry_ms=max(1, int(answer.retry_s * 1000))))
        assert isinstance(answer, NoMoreTask)
        return Reply(encode(m.NO_MORE_TASK, rid, version=version))

    def _update_model(self, request: Request) -> Reply:
        self._check_fp(request)
        rid = request.header.id
        with self._lock:
            old = self._call(
                lambda: self.master.model_out_of_date(request.sender, request.header["version"], time.monotonic())
            )
            version = self.master.version
            params, buffers = self.model.published
        if not old:
            return Reply(encode(m.UP_TO_DATE, rid, version=version))
        header = encode(m.MODEL, rid, version=version, params_bytes=params.nbytes, buffers_bytes=buffers.nbytes)
        return Reply(header, payload=[params, buffers])  # read-only copies of this version: sent without a copy

    def _payload(self, request: Request) -> tuple[np.ndarray, np.ndarray]:
        grads_frame, deltas_frame = request.payload
        if len(grads_frame) != self._params_bytes or len(deltas_frame) != self._buffers_bytes:
            raise ProtocolError(
                "bad_size",
                f"frames of {len(grads_frame)} and {len(deltas_frame)} bytes; this model has "
                f"{self._params_bytes} bytes of gradients and {self._buffers_bytes} of buffers",
            )
        return np.frombuffer(grads_frame.buffer, np.float32), np.frombuffer(deltas_frame.buffer, np.float32)

    def _report_gradients(self, request: Request) -> Reply:
        self._check_fp(request)
        h = request.header
        grads, deltas = self._payload(request)
        with self._lock:
            accepted = self._call(
                lambda: self.master.report_gradients(
                    request.sender,
                    h["task"],
                    h["token"],
                    h["seq"],
                    h["version"],
                    h["batch"],
                    grads,
                    deltas,
                    time.monotonic(),
                )
            )
            if accepted.stepped and self._on_step is not None:
                self._on_step(self.master.version, self.model.samples, self.model)
        return Reply(
            encode(m.ACCEPTED, h.id, version=accepted.version, stepped=accepted.stepped, duplicate=accepted.duplicate)
        )

    def _report_task(self, request: Request) -> Reply:
        self._check_fp(request)
        h = request.header
        with self._lock:
            steps = self.master.steps
            complete = self._call(
                lambda: self.master.report_task(request.sender, h["task"], h["token"], h["status"], time.monotonic())
            )
            if self.master.steps > steps and self._on_step is not None:  # the last, partial step
                self._on_step(self.master.version, self.model.samples, self.model)
        if complete:
            self._complete.set()
        return Reply(encode(m.TASK_RECORDED, h.id, complete=complete))

    def _status(self, request: Request) -> Reply:
        return Reply(encode(m.STATUS_REPLY, request.header.id, **self.status()))
