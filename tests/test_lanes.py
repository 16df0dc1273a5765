"""The unit lane's guard (helpers/lanes.py): a unit test that opens a socket, starts a process or sleeps fails
at that call, naming itself and the marker to add; io and slow tests, and every other thread, are untouched."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import lanes


class Item:
    """What the guard reads of a test: its id and its markers."""

    def __init__(self, *markers: str, fixtures: tuple[str, ...] = ()) -> None:
        self.nodeid = "tests/test_x.py::test_pure"
        self.fixturenames = list(fixtures)
        self._markers = {m: getattr(pytest.mark, m).mark for m in markers}

    def get_closest_marker(self, name: str):
        return self._markers.get(name)

    def add_marker(self, mark) -> None:
        self._markers[mark.name] = mark


def test_this_test_is_a_unit_test_and_runs_guarded():
    assert lanes.guarded()
    with pytest.raises(lanes.UnitTestDidIO, match=r"test_this_test_is_a_unit_test_and_runs_guarded opened a socket"):
        socket.socket()


def test_a_unit_test_may_yield_its_thread_but_never_sleep():
    time.sleep(0)
    with pytest.raises(lanes.UnitTestDidIO, match=r"slept.*@pytest.mark.io"):
        time.sleep(0.001)


def test_a_thread_a_unit_test_starts_is_held_to_the_same_rules():
    caught: list[BaseException] = []

    def opens_a_socket() -> None:
        try:
            socket.socket()
        except lanes.UnitTestDidIO as exc:
            caught.append(exc)

    thread = threading.Thread(target=opens_a_socket)
    thread.start()
    thread.join(10)
    assert len(caught) == 1 and "opened a socket" in str(caught[0])


@pytest.mark.parametrize(
    "call",
    [
        lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
        lambda: __import__("zmq").Context(),
        lambda: __import__("os").fork(),
    ],
    ids=["popen", "zmq", "fork"],
)
def test_a_unit_test_starts_no_process_and_opens_no_zeromq_context(call):
    with pytest.raises(lanes.UnitTestDidIO):
        call()


@pytest.mark.io
def test_an_io_test_is_not_guarded_and_a_unit_phase_inside_it_is():
    assert not lanes.guarded()
    socket.socket().close()  # an io test opens sockets freely
    with lanes.held_to_kind(Item()):  # type: ignore[arg-type]
        assert lanes.guarded()
        with pytest.raises(lanes.UnitTestDidIO, match="tests/test_x.py::test_pure opened a socket"):
            socket.socket()
    assert not lanes.guarded()
    socket.socket().close()
    for marked in (Item("io"), Item("slow")):
        with lanes.held_to_kind(marked):  # type: ignore[arg-type]
            assert not lanes.guarded()


def test_a_test_that_takes_a_fixture_of_nodes_is_io_and_one_marked_slow_stays_slow():
    items = [Item(), Item(fixtures=("nodes",)), Item(fixtures=("tmp_path", "zctx")), Item("slow", fixtures=("nodes",))]
    lanes.classify(items)  # type: ignore[arg-type]
    assert [lanes.kind(i) for i in items] == ["unit", "io", "io", "slow"]  # type: ignore[arg-type]


def test_a_unit_tests_configs_get_distinct_ports_without_a_socket():
    from conftest import make_config

    ports = [spec["port"] for spec in make_config(5)["nodes"]]
    assert len(set(ports)) == 5 and all(20000 <= p < 32000 for p in ports)
