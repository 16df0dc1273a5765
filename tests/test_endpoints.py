"""ipc endpoints: one live owner at most, and no files left behind, whoever dies or sweeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid

import pytest

from dpwa.wire.endpoints import EndpointInUse, EndpointLock, private_dir, sweep

HOLD = """
import sys
from dpwa.wire.endpoints import EndpointLock
lock = EndpointLock(sys.argv[1])
open(lock.socket_path, "w").close()  # stands for the socket file libzmq makes when it binds
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def endpoint():
    return f"ipc://{private_dir()}/test-ep-{uuid.uuid4().hex[:12]}"


def files(endpoint: str) -> list[str]:
    path = endpoint[len("ipc://") :]
    return [p for p in (path, path + ".lock") if os.path.exists(p)]


def holder(endpoint: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_close_removes_the_endpoint_files(endpoint):
    lock = EndpointLock(endpoint)
    open(lock.socket_path, "w").close()
    assert len(files(endpoint)) == 2
    with pytest.raises(EndpointInUse, match="in use by another process"):
        EndpointLock(endpoint)
    lock.close()
    lock.close()  # idempotent
    assert files(endpoint) == []


@pytest.mark.io
def test_files_of_a_killed_owner_are_swept_and_a_live_owner_is_left_alone(endpoint):
    live_endpoint = endpoint + "-live"
    dead, live = holder(endpoint), holder(live_endpoint)
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
        assert len(files(endpoint)) == 2  # SIGKILL: nobody removed them
        with EndpointLock(endpoint + "-other"):  # anyone claiming an endpoint sweeps the directory
            assert files(endpoint) == []
            assert len(files(live_endpoint)) == 2
        with pytest.raises(EndpointInUse):
            EndpointLock(live_endpoint)
    finally:
        for proc in (dead, live):
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    sweep(private_dir())
    assert files(live_endpoint) == []  # its owner is dead now


def test_at_most_one_owner_while_others_claim_release_and_sweep(endpoint):
    """Three claimers and a sweeper race on one endpoint for 300 rounds each: a lock file may be
    removed between a claimer's open and its lock, and the claimer must notice and not count
    itself an owner of a file that is gone."""
    owners, most, claims = [0], [0], [0]
    guard = threading.Lock()
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            for _ in range(300):
                try:
                    lock = EndpointLock(endpoint)
                except EndpointInUse:
                    continue
                with guard:
                    owners[0] += 1
                    most[0] = max(most[0], owners[0])
                    claims[0] += 1
                for _ in range(20):  # own it for a while, so that a second owner would overlap
                    os.sched_yield()
                with guard:
                    owners[0] -= 1
                lock.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def sweeper() -> None:
        for _ in range(300):
            sweep(private_dir())

    threads = [threading.Thread(target=claimer) for _ in range(3)] + [threading.Thread(target=sweeper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors
    assert most[0] == 1 and claims[0] > 0
    assert files(endpoint) == []
