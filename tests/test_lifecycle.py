"""End to end, the life of a cluster: a node killed mid-run rejoins from its peers and the run
finishes; chaos mode; a stopped run resumes from its latest complete checkpoint.

Every process run.sh starts is found through the PID files of the run folder and killed by PID
if it is still there when a test ends.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from test_cluster import ACCURACY_FLOOR, alive, metrics, reap, run_sh

from conftest import ROOT, wait_until
from dpwa.cluster.processes import read_pid_file

pytestmark = pytest.mark.slow


class Foreground:
    """run.sh in the foreground, its output collected on a thread."""

    def __init__(self, runs: Path, *args: str) -> None:
        self.proc = run_sh(runs, *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.out: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None
        self.reader = threading.Thread(target=lambda: self.out.extend(stdout))
        self.reader.start()

    def wait(self, timeout_s: float) -> str:
        self.proc.wait(timeout_s)
        self.reader.join(10)
        return "".join(self.out)


def run_dir_of(runs: Path) -> Path | None:
    latest = runs / "latest"
    return latest.resolve() if latest.exists() else None


def epoch_reached(run_dir: Path, node: str) -> int:
    return max([r["epoch"] for r in metrics(run_dir, node) if r["kind"] == "step"], default=0)


def every_node_reached(runs: Path, nodes: tuple[str, ...], epoch: int) -> bool:
    """True once the latest run exists and each of `nodes` trains epoch `epoch` or later."""
    run_dir = run_dir_of(runs)
    return run_dir is not None and all(epoch_reached(run_dir, n) >= epoch for n in nodes)


def check_finished(run_dir: Path, nodes: list[str]) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    for row in summary["nodes"]:
        assert row["state"] == "done", row
        assert row["test_acc"] >= ACCURACY_FLOOR, row
    assert sorted(r["node"] for r in summary["nodes"]) == nodes
    return summary


def offers_in_log(run_dir: Path, donor: str) -> list[str]:
    """The parameters' BLAKE2b of every join offer the donor's log mentions."""
    text = (run_dir / "logs" / f"{donor}.log").read_text()
    return re.findall(r"offers \S+ its state: .*parameters blake2b ([0-9a-f]{64})", text)


@pytest.mark.timeout(200)
def test_a_node_killed_mid_run_rejoins_from_a_peer_and_the_run_finishes(tmp_path):
    """Three nodes; once they train their second epoch, w2 is killed with SIGKILL. The launcher
    (--restarts 1) starts it again; it takes a donor's state before its first step: its parameters
    are the donor's snapshot (the BLAKE2b the donor logged when it made the offer), its clock goes
    on from the donor's, and it trains on from the cluster's epoch. The run finishes with every
    node done and in the usual accuracy band."""
    runs = tmp_path / "runs"
    run = Foreground(runs, "--nodes", "3", "--epochs", "10", "--restarts", "1", "--print-every", "5")
    try:
        assert wait_until(lambda: every_node_reached(runs, ("w1", "w2", "w3"), 2), 90), "".join(run.out)
        run_dir = run_dir_of(runs)
        assert run_dir is not None
        pid, _ = read_pid_file(run_dir / "pids" / "w2.pid")
        os.kill(pid, signal.SIGKILL)
        out = run.wait(150)
    finally:
        reap(run.proc, runs)
    assert run.proc.returncode == 0, out
    assert "w2 exited with code -9; starting it again (restart 1 of 1)" in out
    summary = check_finished(run_dir, ["w1", "w2", "w3"])
    assert summary["restarts"] == 1 and summary["rejoins"] == 1
    starts = [r for r in metrics(run_dir, "w2") if r["kind"] == "start"]
    assert len(starts) == 2 and starts[1]["started"].startswith("joined the cluster at epoch")
    joined = starts[1]["joined"]
    assert joined["params_blake2b"] in offers_in_log(run_dir, joined["donor"])  # exactly the donor's snapshot
    assert starts[1]["clock"] == joined["clock"] > 0  # its clock goes on from the donor's
    assert starts[1]["first_epoch"] >= 2
    evals = [r["epoch"] for r in metrics(run_dir, "w2") if r["kind"] == "eval"]
    assert evals[-1] == 10
    assert alive(runs) == []


@pytest.mark.timeout(200)
def test_chaos_mode_kills_nodes_now_and_then_and_they_rejoin(tmp_path):
    """./run.sh --chaos: the launcher kills a random training node (one at a time) and starts it
    again; every restarted node rejoins, and the run finishes in the usual band. The summary
    reports the kills, the restarts and the rejoins."""
    runs = tmp_path / "runs"
    run = Foreground(
        runs,
        "--nodes",
        "3",
        "--epochs",
        "14",
        "--chaos",
        "1.5",
        "--chaos-seed",
        "3",
        "--restarts",
        "4",
        "--print-every",
        "5",
    )
    try:
        out = run.wait(180)
    finally:
        reap(run.proc, runs)
    assert run.proc.returncode == 0, out
    run_dir = run_dir_of(runs)
    assert run_dir is not None
    summary = check_finished(run_dir, ["w1", "w2", "w3"])
    assert summary["kills"] >= 1 and summary["restarts"] == summary["kills"], summary
    assert summary["rejoins"] == summary["kills"]
    assert out.count("dpwa: chaos: SIGKILL to") == summary["kills"]
    assert f"chaos and restarts: {summary['kills']} killed" in (run_dir / "summary.txt").read_text()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kills = [e for e in events if e["kind"] == "kill"]
    assert len(kills) == summary["kills"] and all(e["by"] == "chaos" for e in kills)
    assert [e["kind"] for e in events if e["kind"] == "restart"] == ["restart"] * summary["restarts"]
    # what the dashboard marks on its curves: each kill, and each node back in the cluster
    from dpwa.cluster.observe import EventBoard, RunWatcher

    board = EventBoard()
    RunWatcher(run_dir, ["w1", "w2", "w3"], board).poll()
    marks = [e["kind"] for e in board.snapshot() if e["kind"] in ("kill", "rejoin")]
    assert marks.count("kill") == summary["kills"] and marks.count("rejoin") == summary["rejoins"]


@pytest.mark.timeout(200)
def test_a_stopped_run_resumes_where_it_was_stopped(tmp_path):
    """A 2-node run of 6 epochs is stopped (stop.sh: SIGTERM) after its checkpoint of epoch 2; each node
    saves its state as it stops. ./run.sh --resume --epochs 8 continues every node from that state (the
    freshest complete one): its clock, barrier counters, epoch and step, and it trains on to epoch 8, as
    asked. --epochs no more than the run has trained is refused, saying why."""
    runs = tmp_path / "runs"
    proc = None
    try:
        proc = run_sh(
            runs,
            "--nodes",
            "2",
            "--epochs",
            "6",
            "--detach",
            "--grace",
            "10",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        run_dir = run_dir_of(runs)
        assert run_dir is not None
        from dpwa.runfiles import checkpoints

        assert wait_until(
            lambda: (
                2 in checkpoints.epochs(run_dir) and checkpoints.latest_complete(run_dir, ["w1", "w2"]) not in (None, 1)
            ),
            90,
        )
        stop = subprocess.run([str(ROOT / "stop.sh"), str(run_dir)], capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert wait_until(lambda: alive(runs) == [], 30)
        assert checkpoints.latest_complete(run_dir, ["w1", "w2"]) == checkpoints.LAST
        saved = {node: checkpoints.load(run_dir, checkpoints.LAST, node) for node in ("w1", "w2")}
        first_epoch = saved["w1"]["progress"]["epoch"] + 1
        assert 3 <= first_epoch <= 6, "the run ended before it could be stopped"
        done = first_epoch - 1
        refused = subprocess.run(
            [str(ROOT / "run.sh"), "--resume", str(run_dir), "--epochs", str(done)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and alive(runs) == []
        assert (
            f"{run_dir} has trained {done} epochs; --epochs {done} must be more than that to train on "
            "(leave --epochs out to train to 6)"
        ) in refused.stderr
        resumed = Foreground(runs, "--resume", str(run_dir), "--epochs", "8", "--print-every", "5")
        out = resumed.wait(150)
        proc = resumed.proc
    finally:
        reap(proc, runs)
    assert proc.returncode == 0, out
    assert f"resuming {run_dir} from the state every node saved when it was stopped" in out
    assert "--epochs 8: the run trains 8 epochs in all (it was started with 6)" in out
    check_finished(run_dir, ["w1", "w2"])
    for node in ("w1", "w2"):
        records = metrics(run_dir, node)
        start = [r for r in records if r["kind"] == "start"][-1]
        assert start["started"] == "resumed from the state saved when it was stopped"
        assert start["first_epoch"] == saved[node]["progress"]["epoch"] + 1
        assert start["clock"] == saved[node]["dpwa"]["clock"] and start["epochs"] == 8
        after = records[records.index(start) :]
        assert [r["epoch"] for r in after if r["kind"] == "eval"] == list(range(start["first_epoch"], 9))
        assert not checkpoints.has(run_dir, checkpoints.LAST, node)  # taken up: it will not be used twice
    assert alive(runs) == []
