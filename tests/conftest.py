"""Shared fixtures: free ports, configs, nodes that are always closed, children always reaped.

Every test talks to 127.0.0.1 only, on ports picked free at run time, and every
test is bounded: a per-test alarm turns a hang into a failure.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import lanes
from helpers.ports import remember

ROOT = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"
TEST_TIMEOUT_S = int(os.environ.get("DPWA_TEST_TIMEOUT_S", "120"))

# the checkout's library and its lab (lab/, the package dpwa_lab), ahead of any installed copy: here, and through
# CHECKOUT_PATH as PYTHONPATH in the child processes of tests that run the lab (its commands, the examples)
CHECKOUT_PATH = os.pathsep.join([str(ROOT), str(ROOT / "lab")])
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]


# --------------------------------------------------------------------------- bounded tests


@pytest.fixture(autouse=True)
def _alarm(request):
    """Fail a test that runs past its limit (and dump every thread's stack)."""
    marker = request.node.get_closest_marker("timeout")
    limit = int(marker.args[0]) if marker else TEST_TIMEOUT_S

    def on_alarm(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"test exceeded its {limit} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): per-test time limit (default 120 s)")
    lanes.install()
    # Under pytest-xdist each worker draws its nodes' ports from a range of its own (dpwa.cluster.processes
    # .free_ports reads $DPWA_PORTS, and the processes the tests start inherit it), below the kernel's ephemeral
    # range: no two workers ever draw the same port, and no listener the kernel places collides with one.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
        width = 12000 // count
        lo = 20000 + int(worker[2:]) % count * width
        os.environ["DPWA_PORTS"] = f"{lo}-{lo + width - 1}"
    # A shell without job control starts a background command (`./test.sh &`, `nohup ... &`) with SIGINT
    # ignored, and every process the tests start would inherit that: the tests of Ctrl-C (the dashboard,
    # status --watch, a compare run with links) would then wait for a child that never stops. Take SIGINT
    # back, so the children start with it as a terminal gives it.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `-n N` (./test.sh runs -n 2): a test at a time, but a module that builds something once for all
    its tests runs on one worker (helpers/workers.py). Another `--dist` keeps xdist's own scheduler."""
    if config.getoption("dist") != "load":
        return None
    from helpers.workers import OneWorkerPerSharedModule

    return OneWorkerPerSharedModule(config, log)


# --------------------------------------------------------------------------- lanes (helpers/lanes.py)


def pytest_collection_modifyitems(config, items):
    lanes.classify(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with lanes.held_to_kind(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with lanes.held_to_kind(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with lanes.held_to_kind(item):
        return (yield)


# --------------------------------------------------------------------------- ports and configs


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and whose ipc endpoint (where a loopback node
    listens instead of the port) is unclaimed: a live node of another test may hold it, TCP port free."""
    from dpwa.cluster.processes import free_ports

    if lanes.guarded():  # a unit test's config: nothing will listen on it (helpers/lanes.py)
        return lanes.unit_port()
    return remember(free_ports(1)[0])  # the helpers' proxies will not listen on it


def port_is_free(port: int) -> bool:
    """True if a new listener could bind the port now, as a restarted node would.

    SO_REUSEADDR (which ZeroMQ sets too) lets a listener bind over connections
    of a previous listener that are still in TIME_WAIT; it never binds over a
    live listener.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


ORIGINAL = {"mode": "pull", "rule": "state", "pairing": "random"}  # the 2017 rule (preset: original), for tests of it


def make_config(n: int, **settings: Any) -> dict[str, Any]:
    """A mapping-form config for nodes w0..w{n-1} on free loopback ports."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    nodes = [{"name": f"w{i}", "host": "127.0.0.1", "port": p} for i, p in enumerate(sorted(ports))]
    # The library's defaults (mode symmetric, rule delta, pairing auto, f = 1/2), as a user gets them, but
    # two: join: never, so that nodes made one after another in a test start from the values the test gives
    # them (the tests of joining say join: auto), and a 1 s deadline instead of 2.5 s, so that tests of
    # failures end sooner. A test of the 2017 rule says so: make_config(n, **ORIGINAL).
    config = {"nodes": nodes, "timeout_ms": 1000, "join": "never"}
    config.update(settings)
    return config


def serving_only(config: dict[str, Any]) -> dict[str, Any]:
    """The same cluster, seen by a node that never fetches (it only serves)."""
    return {**config, "fetch_probability": 0}


def secure_config(tmp_path: Path, n: int, **settings: Any) -> dict[str, Any]:
    """make_config plus a fresh CURVE key pair per node (keys in tmp_path/keys)."""
    from dpwa.wire.curve import generate

    config = make_config(n, **settings)
    for spec in config["nodes"]:
        _, secret, pair = generate(spec["name"], tmp_path / "keys")
        spec["public_key"] = pair.public.decode()
        spec["secret_key_file"] = str(secret)
    return config


def tcp_endpoint(config: dict[str, Any], name: str) -> str:
    """Where node `name` of `config` is reached."""
    from dpwa import parse_config

    parsed = parse_config(config)
    return parsed.endpoint(parsed.node(name))


def endpoint_is_free(config: dict[str, Any], name: str) -> bool:
    """True if node `name` of `config` could listen now: its TCP port, or its ipc endpoint's lock."""
    from dpwa import parse_config
    from dpwa.wire.endpoints import EndpointInUse, EndpointLock

    parsed = parse_config(config)
    spec = parsed.node(name)
    if parsed.transport == "tcp":
        return port_is_free(spec.port)
    try:
        EndpointLock(parsed.endpoint(spec)).close()
    except EndpointInUse:
        return False
    return True


class ClusterFactory:
    """make_config with one transport's settings added; `transport` says which ("tcp" or "shm")."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self._extra = {"same_host": "off", "insecure": True} if transport == "tcp" else {"same_host": "auto"}

    def __call__(self, n: int, **settings: Any) -> dict[str, Any]:
        return make_config(n, **{**self._extra, **settings})


@pytest.fixture(params=["tcp", "shm"])
def make_cluster(request) -> ClusterFactory:
    """make_config, run once over TCP (insecure: true, payloads over TCP) and once the default
    way (a loopback cluster: ipc sockets, payloads through shared memory)."""
    return ClusterFactory(request.param)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll `predicate` until it is true or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def served_clock(node) -> float:
    """The clock of the snapshot `node` serves its peers (published at update_send: a step behind node.clock)."""
    current = node.services.store.current()
    return current.clock if current is not None else 0.0


def step_until_averaged(node, timeout_s: float = 30.0, peer: str | None = None, step=None):
    """Run steps until one blends a peer's parameters (`peer`'s, if given), or the deadline passes.

    A node whose every peer failed backs off and only probes now and then, so this
    waits in time, not in a number of steps. Returns that step's Update, or None.
    """
    found = []

    def one_step() -> bool:
        if step is not None:
            update = step(node)
        else:
            node.update_send()
            update = node.update_wait()
        if update.averaged and (peer is None or update.peer == peer):
            found.append(update)
        return bool(found)

    wait_until(one_step, timeout_s, interval_s=0.005)
    return found[0] if found else None


@pytest.fixture
def zctx():
    """A ZeroMQ context for the test's own sockets, destroyed with linger 0 afterwards."""
    import zmq

    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# --------------------------------------------------------------------------- nodes in this process


@pytest.fixture
def nodes():
    """A factory of Nodes that are all closed after the test, and checked for stray threads."""
    from dpwa import Node

    made: list[Node] = []
    before = {t.ident for t in threading.enumerate()}

    def make(config, name, params, **kwargs) -> Node:
        node = Node(config, name, params, **kwargs)
        made.append(node)
        return node

    yield make
    # All at once, as a cluster that finishes does: one after another, each closing node's settling would wait
    # out its deadlines on peers already closed (NOTES: about 419 s of a full run went to that).
    close_together(made)
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("dpwa-")]
    assert not leftover, f"threads left behind: {leftover}"


@pytest.fixture
def adapters():
    """A factory of PyTorch adapters that are all closed after the test (the last made first: a requester
    before its peer, which then has nothing left to settle), and checked for stray threads."""
    from dpwa.adapters.pytorch import DpwaPyTorchAdapter

    made: list[DpwaPyTorchAdapter] = []
    before = {t.ident for t in threading.enumerate()}

    def make(*args: Any, **kwargs: Any) -> DpwaPyTorchAdapter:
        adapter = DpwaPyTorchAdapter(*args, **kwargs)
        made.append(adapter)
        return adapter

    yield make
    for adapter in reversed(made):
        adapter.close()
    leftover = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("dpwa-")]
    assert not leftover, f"threads left behind: {leftover}"


def filled(k: float, size: int = 1000) -> np.ndarray:
    return np.full(size, float(k), dtype=np.float32)


# --------------------------------------------------------------------------- nodes in child processes


class ChildNode:
    """A node in a child process, driven over stdin/stdout with JSON lines."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdin is not None and proc.stdout is not None, "the child needs text pipes for stdin and stdout"
        self.proc = proc
        self._stdin = proc.stdin
        self._stdout = proc.stdout
        self._lines: list[dict] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._cv:
                self._lines.append(message)
                self._cv.notify_all()

    def expect(self, event: str, timeout_s: float = 30.0) -> dict:
        """Wait for the next line whose "event" is `event`."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for i, message in enumerate(self._lines):
                    if message.get("event") == event:
                        return self._lines.pop(i)
                    if message.get("event") == "error":
                        raise AssertionError(f"child failed: {message}")
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._lines):
                    raise AssertionError(
                        f"child pid {self.proc.pid} sent no {event!r} within {timeout_s} s "
                        f"(exit code {self.proc.poll()})"
                    )
                self._cv.wait(min(remaining, 0.2))

    def send(self, **command: Any) -> None:
        self._stdin.write(json.dumps(command) + "\n")
        self._stdin.flush()

    def stop(self, timeout_s: float = 10.0) -> int:
        """Ask the child to close its node and exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.send(cmd="exit")
                self._stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


@pytest.fixture
def children(tmp_path):
    """Start helper node processes; every one is stopped and reaped by PID afterwards."""
    started: list[ChildNode] = []

    def start(config: dict, name: str, **options: Any) -> ChildNode:
        path = tmp_path / f"{name}-{len(started)}.json"
        path.write_text(json.dumps(config))
        cmd = [
            sys.executable,
            str(HELPERS / "child_node.py"),
            "--config",
            str(path),
            "--name",
            name,
            "--options",
            json.dumps(options),
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        child = ChildNode(proc)
        started.append(child)
        return child

    yield start
    for child in started:
        if child.proc.poll() is None:
            child.proc.kill()
        child.proc.wait(10)


# --------------------------------------------------------------------------- nodes stepping on threads


class Steppers:
    """Each node steps on a thread of its own until stop() (bounded: joined with a deadline)."""

    def __init__(self) -> None:
        self._threads: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self.errors: list[BaseException] = []

    def start(self, node: Any) -> None:
        stop = threading.Event()

        def run() -> None:
            try:
                while not stop.is_set() and not node.closed:
                    node.update_send()
                    node.update_wait()
            except RuntimeError:
                if not node.closed:
                    raise
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=f"stepper-{node.name}", daemon=True)
        self._threads[node.name] = (thread, stop)
        thread.start()

    def stop(self, name: str | None = None) -> None:
        names = [name] if name is not None else list(self._threads)
        for key in names:
            thread, stop = self._threads.pop(key)
            stop.set()
            thread.join(10)
            assert not thread.is_alive(), f"the stepper of {key} did not stop"


@pytest.fixture
def steppers():
    made = Steppers()
    yield made
    made.stop()
    assert not made.errors, made.errors


def close_together(group) -> None:
    """Close every node at once, as a cluster that finishes does: each settles with the others."""
    threads = [threading.Thread(target=node.close) for node in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(node.closed for node in group)
