"""Graceful stops: turn SIGTERM into an ordinary exit, so every ``with`` block unwinds.

Example::

    from dpwa.signals import stop_on_signals

    with stop_on_signals(), DpwaPyTorchAdapter(net, name, config) as conn:
        train(conn)          # SIGTERM: the adapter closes its sockets, files are flushed

Python already turns SIGINT (Ctrl-C) into KeyboardInterrupt; SIGTERM, which
``stop.sh`` and most schedulers send, kills the process without unwinding
unless a handler says otherwise.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Stopped", "stop_on_signals"]


class Stopped(SystemExit):
    """Raised in the main thread when a stop signal arrives; exits with status 0."""

    def __init__(self, signum: int) -> None:
        super().__init__(0)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Iterator[None]:
    """Within the block, a signal in `signals` raises :class:`Stopped` in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("stop_on_signals() must be used from the main thread")

    def handler(signum: int, frame: object) -> None:
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
