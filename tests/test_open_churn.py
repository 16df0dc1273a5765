"""Open membership under churn (issue 32): eight nodes from one bootstrap address, two killed, three joining.

On real nodes over this machine's loopback (ipc): six nodes in this process, driven in lock step, and two
in processes of their own, started with the same bootstrap address (w0's).

1. Within a bound every node's view holds all eight (each one's own, asked over the wire: its status lists
   its peers, which follow its view), and every pair of nodes has exchanged (pairing ``random``: every pair
   is one it uses).
2. The two processes are SIGKILLed (by PID) and three nodes join, each through a different member (not w0):
   every view converges to the nine within ``suspect_after_ms`` + ``dead_after_ms`` plus slack.
3. The mean is kept in mode symmetric: from a settled point (no node starts an exchange until none is
   pending anywhere) the nine train on with steps that sum to zero, so every committed exchange must keep
   the sum of the nine models exactly (to float rounding), as the chaos test checks for a fixed cluster.
4. A barrier completes with the new membership: the nine each call it, and none is left waiting for a
   member that died.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from test_open_membership import open_config

from conftest import close_together, make_config, wait_until
from dpwa import NumpyParams
from dpwa.cluster.status import StatusClient

SUSPECT_MS, DEAD_MS, TIMEOUT_MS = 2000, 2000, 1000  # longer than the other tests': 8 to 11 nodes on 2 cores
SIZE = 64


class LockStep:
    """Steps a changing group of in-process nodes in rounds on one thread: every node's update_send, then
    a step of each array (the steps sum to zero over the group, and alternate in sign), then every node's
    update_wait. ``waits_only()`` makes the rounds update_wait only (no exchange is started); ``step()`` again."""

    def __init__(self) -> None:
        self.group: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._tending = threading.Event()
        self.rounds = 0
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="lockstep", daemon=True)

    def start(self) -> LockStep:
        self._thread.start()
        return self

    def add(self, node: Any) -> None:
        with self._lock:
            self.group.append(node)

    def waits_only(self) -> None:
        self._tending.set()

    def step(self) -> None:
        self._tending.clear()

    def _run(self) -> None:
        sign = np.float32(1)
        try:
            while not self._stop.is_set():
                with self._lock:
                    group = list(self.group)
                tending = self._tending.is_set()
                if not tending:
                    for node in group:
                        node.update_send()
                    steps = [np.float32(0.5 if k % 2 == 0 else -0.5) for k in range(len(group) - len(group) % 2)]
                    for node, delta in zip(group, steps, strict=False):
                        node.params.array += sign * delta
                    sign = -sign
                for node in group:
                    node.update_wait()
                self.rounds += 1
                if tending:
                    self._stop.wait(0.01)  # a bounded pause between rounds that only apply what settled
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the lock-step thread did not stop"
        assert not self.errors, self.errors


def total(group: list[Any]) -> np.ndarray:
    return np.sum([node.params.array.astype(np.float64) for node in group], axis=0)


def status_rows(config: Any) -> dict[str, dict[str, Any]]:
    with StatusClient(config) as client:
        return {row["name"]: row for row in client.ask(TIMEOUT_MS / 1000)}


def all_pairs_exchanged(rows: dict[str, dict[str, Any]], names: list[str]) -> bool:
    def averaged(a: str, b: str) -> int:
        return int(rows.get(a, {}).get("peers", {}).get(b, {}).get("averaged", 0))

    return all(averaged(a, b) + averaged(b, a) > 0 for a, b in itertools.combinations(names, 2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eight_nodes_two_killed_three_joining_views_mean_and_barrier(nodes, children):
    specs = make_config(11)["nodes"]
    settings = {"suspect_after_ms": SUSPECT_MS, "dead_after_ms": DEAD_MS, "timeout_ms": TIMEOUT_MS}
    rng = np.random.default_rng(7)
    driver = LockStep()
    try:
        # 1. eight nodes from one bootstrap address: w0..w5 here, w6 and w7 in processes of their own
        for i in range(6):
            values = (i + rng.standard_normal(SIZE)).astype(np.float32)
            driver.add(nodes(open_config(specs[i], [specs[0]], **settings), f"w{i}", NumpyParams(values)))
        driver.start()
        doomed = []
        for i in (6, 7):
            child = children(open_config(specs[i], [specs[0]], **settings), f"w{i}", fill=float(i), size=SIZE)
            doomed.append(child)
        for child in doomed:
            child.expect("ready", timeout_s=60)
            child.send(cmd="steps", n=10**7)  # it steps until it is killed
        eight = sorted(f"w{i}" for i in range(8))
        first = driver.group[0].config
        rows: dict[str, dict[str, Any]] = {}

        def everyone_sees_eight_and_every_pair_exchanged() -> bool:
            nonlocal rows
            rows = status_rows(first)
            return (
                sorted(rows) == eight
                and all(sorted([name, *row.get("peers", {})]) == eight for name, row in rows.items())
                and all_pairs_exchanged(rows, eight)
            )

        assert wait_until(everyone_sees_eight_and_every_pair_exchanged, 90.0, 0.5), rows
        # 2. two killed (SIGKILL, by PID); three join, each through a different member than w0
        for child in doomed:
            child.proc.send_signal(signal.SIGKILL)
            child.proc.wait(10)
        killed_at = time.monotonic()
        for i, through in ((8, 1), (9, 2), (10, 3)):
            config = open_config(specs[i], [specs[through]], join="auto", **settings)
            joiner = nodes(config, f"w{i}", NumpyParams(np.zeros(SIZE, dtype=np.float32)))
            assert joiner.joined is not None and joiner.joined.rejoined, joiner.joined  # a trained member's state
            driver.add(joiner)
        nine = sorted(node.name for node in driver.group)
        assert nine == sorted(f"w{i}" for i in (0, 1, 2, 3, 4, 5, 8, 9, 10))
        bound_s = (SUSPECT_MS + DEAD_MS) / 1000 + 20.0  # slack: the joins themselves, and a loaded machine
        assert wait_until(lambda: all(node.members.names() == nine for node in driver.group), bound_s, 0.05), {
            node.name: node.members.names() for node in driver.group
        }
        converged_s = time.monotonic() - killed_at
        # 3. a settled point: no node starts an exchange until nothing is pending anywhere
        driver.waits_only()
        group = list(driver.group)
        settled = wait_until(lambda: all(node._reporter.status()["pending"] == 0 for node in group), 15.0, 0.02)
        assert settled, {node.name: node._reporter.status()["pending"] for node in group}
        rounds = driver.rounds
        assert wait_until(lambda: driver.rounds >= rounds + 2, 5.0, 0.01)  # what settled is applied
        start = total(group)
        before = {node.name: node.stats()["averaged"] for node in group}
        driver.step()
        assert wait_until(lambda: sum(n.stats()["averaged"] - before[n.name] for n in group) >= 60, 60.0, 0.05)
        newcomers_averaged = {n.name: n.stats()["averaged"] - before[n.name] for n in group if n.name in {"w8", "w9"}}
        driver.stop()
        # 4. a barrier with the nine: each calls it, and it completes
        missing: dict[str, list[str]] = {}
        threads = [
            threading.Thread(target=lambda n=node: missing.update({n.name: n.barrier("churned", timeout_s=60)}))
            for node in group
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert missing == {name: [] for name in nine}, missing
        close_together(group)
        drift = np.abs(total(group) - start).max()
        assert drift < 1e-3, drift  # float32 rounding of values near 10 over a few hundred exchanges
        assert any(count > 0 for count in newcomers_averaged.values()), newcomers_averaged
        print(f"views converged {converged_s:.1f} s after the kills; drift {drift:.2e}")
    finally:
        if driver._thread.is_alive():
            driver._stop.set()
            driver._thread.join(30)
