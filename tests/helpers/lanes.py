"""The suite's lanes: every test is of one kind, and a unit test is held to it.

Kinds, by marker:
- `slow`: starts processes (nodes in children, run.sh, torchrun, compare, bench) or waits out long deadlines;
- `io`: one process, but sockets, threads of nodes, or real time (a node, a ZeroMQ socket, a sleep);
- neither: a unit test, of pure code (mixing, membership, admission, schema, codecs, parsing).

A test is `io` when it says so (`pytest.mark.io`, on it or its module) or when it takes a fixture that makes
nodes or sockets (IO_FIXTURES). Every other test that is not `slow` is a unit test, and runs under a guard,
in every lane: a unit test that opens a socket or a ZeroMQ context, starts a process, or sleeps fails at that
call, with the marker to add. So `./test.sh --unit` (`-m "not slow and not io"`) stays free of I/O as tests are
added, and the classification cannot drift: CI runs every unit test under the same guard.
"""

from __future__ import annotations

import functools
import itertools
import os
import posix
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# The most tests the suite may mark slow. Adding one past it is a decision: raise this number in the same
# commit, and say in docs/testing.md ('The budget') what the new test proves that a faster one could not.
SLOW_TESTS_MAX = 94

IO_FIXTURES = frozenset({"nodes", "adapters", "zctx", "children", "steppers", "make_cluster"})
UNIT_LANE = "not slow and not io"


class UnitTestDidIO(AssertionError):
    """A unit test (neither `slow` nor `io`) opened a socket, started a process or slept."""


def kind(item: pytest.Item) -> str:
    """ "slow", "io" or "unit": the lane `item` belongs to."""
    if item.get_closest_marker("slow"):
        return "slow"
    if item.get_closest_marker("io"):
        return "io"
    return "unit"


def classify(items: list[pytest.Item]) -> None:
    """Mark `io` every test that is not `slow` and takes a fixture that makes nodes or sockets."""
    for item in items:
        if kind(item) == "unit" and IO_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.io)


_guard = threading.local()
_guarded_threads: set[int] = set()  # the threads of the unit test now running (its own, and those it started)
_guard_lock = threading.Lock()
_patched = False
_unit_ports = itertools.count()  # handed out to unit tests that build configs: nothing of theirs listens


def guarded() -> bool:
    """True on a thread of a unit test that is running now."""
    return threading.get_ident() in _guarded_threads


def unit_port() -> int:
    """A port number for a config a unit test builds: it is never bound (the guard forbids it), so it need
    not be free; each is distinct within the run."""
    return 20000 + next(_unit_ports) % 12000


def _refuse(what: str) -> None:
    test = getattr(_guard, "test", None) or "this unit test"
    raise UnitTestDidIO(
        f"{test} {what}, but it is a unit test (neither slow nor io): a unit test opens no socket, starts no "
        "process and never sleeps. Mark it @pytest.mark.io (one process, sockets or real time) or "
        "@pytest.mark.slow (processes), or take the I/O out of it (docs/testing.md, 'The lanes')."
    )


def _wrap(owner: Any, name: str, what: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)  # its own name, module and qualname: pickle still finds `os.system` by name
    def checked(*args: Any, **kwargs: Any) -> Any:
        if guarded():
            if name == "sleep" and args and args[0] == 0:
                return original(*args, **kwargs)  # a yield of the thread, no wait
            _refuse(what)
        return original(*args, **kwargs)

    setattr(owner, name, checked)
    if owner is os:  # os.system is posix.system: pickle (and anyone) finds the one object under both names
        setattr(posix, name, checked)


def _wrap_thread_start() -> None:
    original = threading.Thread.start

    def start(self: threading.Thread, *args: Any, **kwargs: Any) -> None:
        if not guarded():
            return original(self, *args, **kwargs)
        run = self.run
        test = getattr(_guard, "test", None)

        def guarded_run() -> None:  # a thread a unit test starts is held to the same rules
            ident = threading.get_ident()
            with _guard_lock:
                _guarded_threads.add(ident)
            _guard.test = test
            try:
                run()
            finally:
                with _guard_lock:
                    _guarded_threads.discard(ident)

        self.run = guarded_run  # type: ignore[method-assign]
        return original(self, *args, **kwargs)

    threading.Thread.start = start  # type: ignore[method-assign]


def install() -> None:
    """Patch the calls a unit test may not make; a no-op for every thread but a running unit test's."""
    global _patched
    if _patched:
        return
    _patched = True
    _wrap(socket.socket, "__init__", "opened a socket")
    _wrap(subprocess.Popen, "__init__", "started a process")
    _wrap(os, "fork", "forked")
    _wrap(os, "posix_spawn", "started a process")
    _wrap(os, "system", "started a process")
    _wrap(time, "sleep", "slept")
    import multiprocessing.process

    _wrap(multiprocessing.process.BaseProcess, "start", "started a process")
    try:
        import zmq
    except ImportError:  # pragma: no cover - pyzmq is a dependency
        pass
    else:
        _wrap(zmq.Context, "__init__", "opened a ZeroMQ context")
    _wrap_thread_start()


@contextmanager
def held_to_kind(item: pytest.Item) -> Iterator[None]:
    """Run a phase of `item`; a unit test's with the guard on for its thread and every thread it starts."""
    if kind(item) != "unit":
        yield
        return
    ident = threading.get_ident()
    _guard.test = item.nodeid
    with _guard_lock:
        _guarded_threads.add(ident)
    try:
        yield
    finally:
        with _guard_lock:
            _guarded_threads.discard(ident)
        _guard.test = None
