"""docs/operations.md's walkthrough, run as written: two nodes to five across three namespaces, and back.

The subsection "Across three network namespaces: two nodes to five and back" holds ```bash blocks, each
after a ``<!-- walkthrough: STEP -->`` line. This test runs them in order, each with ``bash -e``, changing
only the namespace prefix (``dpwawalk`` becomes ``dpwawalk<PID>x``, which names the files' folder under
/tmp too, so parallel runs never meet) and ``.venv/bin/python`` (this interpreter). Between the steps it
asks every node's status (``python -m dpwa status CONFIG --json``, from the node's namespace) until each
sees the members it should: all five after the growth, the three survivors within suspect_after_ms +
dead_after_ms (and slack) after two are stopped. On every exit path the nodes it started are killed by
PID and the namespaces with its prefix are deleted; it checks that none is left.
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

import pytest
from test_links import namespaces, needs_namespaces

from conftest import ROOT, wait_until

DOC = ROOT / "docs" / "operations.md"
STEPS = ["namespaces", "start two", "start three more", "status five", "stop two", "status three", "teardown"]
NAMESPACE = {f"w{n}": (n - 1) % 3 + 1 for n in range(1, 6)}  # as the walkthrough places them
SUSPECT_S, DEAD_S = 2.0, 2.0  # the walkthrough's suspect_after_ms, dead_after_ms
GROW_S = 60.0  # five nodes up (each imports torch) and in every view
SLACK_S = 16.0  # beyond suspect + dead: status calls on a busy 2-core machine (10 s in all seen here)
STEP_S = 30


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


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_walkthrough_grows_to_five_and_shrinks_to_three():
    prefix = f"dpwawalk{os.getpid()}x"  # x: no other run's prefix starts with ours
    folder = Path("/tmp") / prefix
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
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

    def views(names: list[str]) -> dict[str, object]:
        """Each node's status of the cluster, asked with its config from its namespace: the names listed,
        and each row's peers (that node's view of the others)."""
        seen: dict[str, object] = {}
        for name in names:
            asked = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    f"{prefix}{NAMESPACE[name]}",
                    sys.executable,
                    "-m",
                    "dpwa",
                    "status",
                    str(folder / f"{name}.yaml"),
                    "--json",
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=STEP_S,
            )
            try:
                rows = json.loads(asked.stdout)["nodes"]
            except (ValueError, KeyError):
                seen[name] = asked.stdout + asked.stderr
                continue
            seen[name] = {
                row["name"]: sorted(row.get("peers", {})) if row["state"] != "unreachable" else "unreachable"
                for row in rows
            }
        return seen

    def expect(names: list[str], within_s: float) -> float:
        """Poll until every node of `names` lists exactly `names`, each seeing the others; the seconds taken."""
        want = {name: sorted(set(names) - {name}) for name in names}
        start = time.monotonic()
        deadline = start + within_s
        seen: dict[str, object] = {}
        while time.monotonic() < deadline:
            seen = views(names)
            if all(view == want for view in seen.values()):
                return time.monotonic() - start
        logs = {p.name: p.read_text()[-1500:] for p in folder.glob("*.log")}
        raise AssertionError(f"within {within_s:.0f} s the views were not {want}: {seen}\nlogs: {logs}")

    try:
        run("namespaces")
        assert sorted(namespaces(prefix)) == [f"{prefix}{i}" for i in (1, 2, 3)]
        run("start two")
        expect(["w1", "w2"], GROW_S)
        run("start three more")
        expect(["w1", "w2", "w3", "w4", "w5"], GROW_S)
        run("status five")
        stopped = {int((folder / f"{name}.pid").read_text()) for name in ("w4", "w5")}
        run("stop two")
        took = expect(["w1", "w2", "w3"], SUSPECT_S + DEAD_S + SLACK_S)
        print(f"w4 and w5 left the survivors' views {took:.1f} s after SIGTERM")
        assert wait_until(lambda: not any(alive(pid) for pid in stopped), 20, 0.1), "w4 or w5 runs after SIGTERM"
        run("status three")
        survivors = started - stopped
        run("teardown")
        assert len(started) == 5
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
