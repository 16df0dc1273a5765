"""docs/operations.md's walkthrough, run as written: a public node and two homes behind firewalls, five nodes.

The subsection "Across three network namespaces: two homes behind firewalls and a public node" holds ```bash
blocks, each after a ``<!-- walkthrough: STEP -->`` line. This test runs them in order, each with ``bash -e``,
changing only the namespace prefix (``dpwawalk`` becomes ``dpwawalk<PID>x``, which names the files' folder
under /tmp too, so parallel runs never meet) and ``.venv/bin/python`` (this interpreter). The homes' firewalls
(iptables) drop every connection attempt from outside, so every exchange with a home node goes through the
public node's relay, homes with each other included. Between the steps it asks the cluster's status (``python
-m dpwa status CONFIG --json`` with w2's config, from w2's home: every row is that node's own view) until each
node sees the members it should, and every pair has averaged (each node's ``peers[...].averaged``): all five after the start; four within
suspect_after_ms + dead_after_ms (and slack) after a home node is killed; five again when it is back; and
after the public node's restart, every pair averaging anew. On every exit path the nodes it started are
killed by PID and the namespaces with its prefix are deleted; it checks that none is left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_links import namespaces, needs_namespaces

from conftest import CHECKOUT_PATH, ROOT, wait_until

DOC = ROOT / "docs" / "operations.md"
STEPS = [
    "namespaces",
    "start five",
    "status five",
    "cannot dial",
    "kill a home node",
    "start it again",
    "restart the public node",
    "teardown",
]
NAMESPACE = {"w1": 1, "w2": 2, "w3": 3, "w4": 2, "w5": 3}  # as the walkthrough places them
SUSPECT_S, DEAD_S = 2.0, 2.0  # the walkthrough's suspect_after_ms, dead_after_ms
GROW_S = 60.0  # five nodes up (each imports torch), in every view, every pair averaged
SLACK_S = 16.0  # beyond suspect + dead: status calls on a busy 2-core machine (10 s in all seen here)
STEP_S = 30
ALL = ["w1", "w2", "w3", "w4", "w5"]
ASKER = "w2"  # whose config asks the status, from its home: never killed, and it reaches the others through the relay


def walkthrough() -> dict[str, str]:
    """The walkthrough's bash blocks, by step."""
    text = DOC.read_text(encoding="utf-8")
    return dict(re.findall(r"^<!-- walkthrough: ([^>]+?) -->\n```bash\n(.*?)^```\n", text, re.M | re.S))


def test_the_document_has_every_step_in_order():
    assert list(walkthrough()) == STEPS


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def ours(pid: int, folder: Path) -> bool:
    """Whether `pid` is one of this run's nodes (its environment names our folder)."""
    try:
        return str(folder).encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


needs_iptables = pytest.mark.skipif(
    shutil.which("iptables") is None, reason="iptables is not installed (test.sh installs it as root with apt-get)"
)


@needs_namespaces
@needs_iptables
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_walkthrough_trains_five_through_firewalls_and_survives_restarts():
    prefix = f"dpwawalk{os.getpid()}x"  # x: no other run's prefix starts with ours
    folder = Path("/tmp") / prefix
    env = {**os.environ, "PYTHONPATH": CHECKOUT_PATH}
    blocks = {
        step: block.replace("dpwawalk", prefix).replace(".venv/bin/python", sys.executable)
        for step, block in walkthrough().items()
    }
    started: set[int] = set()

    def run(step: str) -> None:
        done = subprocess.run(
            ["bash", "-e", "-c", blocks[step]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=STEP_S
        )
        assert done.returncode == 0, f"step {step!r}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
        print(f"step {step!r}:\n{done.stdout}", end="")
        started.update(int(p.read_text()) for p in folder.glob("*.pid"))

    def views(names: list[str]) -> dict[str, Any]:
        """The cluster's status as ASKER sees it, asked with its config from its home: each row's peers (that
        node's own view of the others) and how often it averaged with each. One process a round: each one
        imports dpwa and torch, and five a round (one per node) slowed the nodes they watched on 2 cores."""
        asked = {
            name: subprocess.Popen(
                ["ip", "netns", "exec", f"{prefix}{NAMESPACE[name]}", sys.executable, "-m", "dpwa", "status"]
                + [str(folder / f"{name}.yaml"), "--json"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for name in [ASKER]
        }
        seen: dict[str, Any] = {}
        for name, child in asked.items():
            try:
                out, _ = child.communicate(timeout=STEP_S)
            except subprocess.TimeoutExpired:
                child.kill()
                out, _ = child.communicate()
            try:
                rows = json.loads(out)["nodes"]
            except (ValueError, KeyError):
                seen[name] = out
                continue
            seen[name] = {
                row["name"]: {peer: info.get("averaged", 0) for peer, info in row.get("peers", {}).items()}
                if row["state"] != "unreachable"
                else "unreachable"
                for row in rows
            }
        return seen

    def expect(
        names: list[str], within_s: float, more_than: dict[tuple[str, str], int] | None = None
    ) -> dict[str, Any]:
        """Poll until every node of `names` lists exactly `names`, each seeing the others and having averaged
        with each (more than `more_than` says, per pair); the last answer of one node."""
        start = time.monotonic()
        deadline = start + within_s
        seen: dict[str, Any] = {}
        floor = more_than or {}
        while time.monotonic() < deadline:
            seen = views(names)
            good = all(
                isinstance(view, dict)
                and sorted(view) == sorted(names)
                and all(
                    isinstance(view[n], dict)
                    and sorted(view[n]) == sorted(set(names) - {n})
                    and all(count > floor.get((n, m), 0) for m, count in view[n].items())
                    for n in names
                )
                for view in seen.values()
            )
            if good:
                print(f"{names} in every view, every pair averaged, after {time.monotonic() - start:.1f} s")
                answer: dict[str, Any] = next(iter(seen.values()))
                return answer
        logs = {p.name: p.read_text()[-1500:] for p in folder.glob("*.log")}
        raise AssertionError(f"within {within_s:.0f} s not every pair of {names} averaged: {seen}\nlogs: {logs}")

    try:
        run("namespaces")
        assert sorted(namespaces(prefix)) == [f"{prefix}{i}" for i in (1, 2, 3)]
        run("start five")
        expect(ALL, GROW_S)
        run("status five")
        run("cannot dial")
        killed = int((folder / "w5.pid").read_text())
        run("kill a home node")
        assert wait_until(lambda: not alive(killed), 10, 0.1), "w5 runs after SIGKILL"
        expect(ALL[:4], SUSPECT_S + DEAD_S + SLACK_S)
        run("start it again")
        before = expect(ALL, GROW_S)  # and the counts the homes had before the public node went
        public = int((folder / "w1.pid").read_text())
        run("restart the public node")
        assert not alive(public)
        homes = {(n, m): before[n][m] for n in ALL[1:] for m in ALL[1:] if n != m}
        expect(ALL, GROW_S, more_than=homes)  # w1 anew with each, and the homes with each other again
        survivors = {int(p.read_text()) for p in folder.glob("*.pid")}
        run("teardown")
        assert wait_until(lambda: not any(alive(pid) for pid in survivors), 20, 0.1), "a node runs after teardown"
        assert namespaces(prefix) == []
        assert not folder.exists()
    finally:
        for pid in started:
            if alive(pid) and ours(pid, folder):
                os.kill(pid, signal.SIGKILL)
        for name in namespaces(prefix):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)
        wait_until(lambda: not any(alive(pid) for pid in started), 10, 0.1)
    assert not [pid for pid in started if alive(pid)]
    assert namespaces(prefix) == []
