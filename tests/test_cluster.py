"""End to end: ./run.sh trains a 2-node cluster on the embedded digits; ./stop.sh and Ctrl-C stop one.

run.sh sources scripts/ensure-venv.sh, which finds .venv up to date when the
suite runs from ./test.sh, so nothing is installed here. Ports are picked
free by run.sh at start, on 127.0.0.1. Every process run.sh starts is found
through the PID files of the run folder and killed by PID if it is still
there when a test ends, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, port_is_free, wait_until
from dpwa import load_config
from dpwa.cluster.processes import process_start, read_pid_file

pytestmark = pytest.mark.slow

ACCURACY_FLOOR = 0.90


def pid_files(runs: Path) -> list[Path]:
    return sorted(p for p in runs.glob("*/pids/*.pid") if not p.parent.parent.is_symlink())


def alive(runs: Path) -> list[str]:
    """The processes of the PID files under `runs` that still run (start time checked)."""
    out = []
    for path in pid_files(runs):
        pid, start = read_pid_file(path)
        if process_start(pid) == start:
            out.append(f"{path.stem} (pid {pid})")
    return out


def reap(proc: subprocess.Popen | None, runs: Path) -> None:
    """Stop run.sh (if running) and every process its PID files name, by PID."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for path in pid_files(runs):
        pid, start = read_pid_file(path)
        if process_start(pid) == start:
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(runs), 10)


def run_sh(runs: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [str(ROOT / "run.sh"), "--runs-dir", str(runs), *args], cwd=ROOT, text=True, start_new_session=True, **popen
    )


def metrics(run_dir: Path, node: str) -> list[dict]:
    path = run_dir / "metrics" / f"{node}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def training(run_dir: Path, nodes=("w1", "w2")) -> bool:
    return all(any(r["kind"] == "step" for r in metrics(run_dir, n)) for n in nodes)


@pytest.mark.timeout(150)
def test_run_sh_trains_two_nodes_on_digits_that_average_with_each_other(tmp_path):
    """Two nodes, 8 epochs on their halves of the digits training split (719 and 718 images).

    Measured on this 2-core machine (4 runs): each node and their parameter average reach
    98.1-98.9% test accuracy (360 test images), with about 10 s of training. The floor of
    90% leaves room for an unlucky run; a node that did not learn sits near 10%. Accuracy
    alone cannot show averaging (with fetch_probability 0 each node still reaches 97-98% on
    its half, measured), so the test checks the per-peer counts of successful averages.
    """
    runs = tmp_path / "runs"
    proc = None
    try:
        proc = run_sh(
            runs,
            "--nodes",
            "2",
            "--epochs",
            "8",
            "--print-every",
            "2",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out, _ = proc.communicate(timeout=120)
    finally:
        reap(proc, runs)
    assert proc.returncode == 0, out
    run_dir = (runs / "latest").resolve()
    assert out.count("embedded handwritten digits") == 1  # said once, in one line
    assert f"-m dpwa dashboard {run_dir}  (prints its URL)" in out  # how to watch it in a browser
    assert "w1 <- w2" in out and "average  2 nodes" in out

    config = load_config(run_dir / "config.yaml")
    assert [(n.name, n.host) for n in config.nodes] == [("w1", "127.0.0.1"), ("w2", "127.0.0.1")]
    for name in ("w1", "w2"):
        assert "done after" in (run_dir / "logs" / f"{name}.log").read_text()
        records = metrics(run_dir, name)
        evals = [r for r in records if r["kind"] == "eval"]
        assert [r["epoch"] for r in evals] == list(range(1, 9))
        assert evals[-1]["test_acc"] >= ACCURACY_FLOOR, evals[-1]
        end = records[-1]
        assert end["kind"] == "end" and end["reason"] == "done"
        peer = "w2" if name == "w1" else "w1"
        assert end["peers"].get(peer, 0) > 0, f"{name} never averaged with {peer}: {end}"
        assert end["stats"]["requests_served"] > 0  # and the peer fetched from it
        assert (run_dir / "models" / f"{name}.pt").stat().st_size > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["average"]["models"] == 2 and summary["average"]["test_acc"] >= ACCURACY_FLOOR
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "summary.txt").read_text().startswith("node")
    assert {p.stem for p in pid_files(runs)} == {"launcher", "w1", "w2", "finish"}  # finish: the average
    assert alive(runs) == []
    assert all(port_is_free(n.port) for n in config.nodes)


@pytest.mark.timeout(120)
def test_stop_sh_stops_a_detached_cluster_and_nothing_else(tmp_path):
    runs = tmp_path / "runs"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # must survive stop.sh
    proc = None
    try:
        proc = run_sh(
            runs,
            "--nodes",
            "2",
            "--epochs",
            "1000",
            "--detach",
            "--grace",
            "5",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out, _ = proc.communicate(timeout=60)  # --detach returns once every node has started
        assert proc.returncode == 0, out
        assert "started in the background" in out
        run_dir = (runs / "latest").resolve()
        assert wait_until(lambda: training(run_dir), 60), alive(runs)
        assert len(alive(runs)) == 3  # the background launcher and two nodes
        # A stale PID file: the bystander's PID with another start time, as after a reboot.
        (run_dir / "pids" / "stale.pid").write_text(f"{bystander.pid} 1\n")

        t0 = time.monotonic()
        done = subprocess.run(
            [str(ROOT / "stop.sh"), "--grace", "20", str(run_dir)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert time.monotonic() - t0 < 20  # every process ended on SIGTERM, no SIGKILL needed
        assert "stopped 3 processes" in done.stdout and "SIGKILL" not in done.stdout
        assert alive(runs) == []  # the stale file does not count: its start time is not the bystander's
        assert bystander.poll() is None  # the reused PID was not signalled
        for name in ("w1", "w2"):
            assert metrics(run_dir, name)[-1]["reason"] == "stopped by SIGTERM"  # a clean stop
        summary = (run_dir / "summary.txt").read_text()
        assert "the run was stopped; to evaluate it anyway: " in summary  # the launcher finished its job
        assert f"evaluate.py {run_dir}\n" in summary and "--data-dir" not in summary  # digits: no CIFAR-10 folder
        assert f"-m dpwa dashboard {run_dir}   (prints its URL)" in out  # how to watch it in a browser
        again = subprocess.run([str(ROOT / "stop.sh"), str(run_dir)], capture_output=True, text=True, timeout=30)
        assert again.returncode == 0 and "nothing to stop" in again.stdout
    finally:
        reap(proc, runs)
        bystander.kill()
        bystander.wait(10)


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_node_cleanly(tmp_path):
    runs = tmp_path / "runs"
    proc = None
    try:
        proc = run_sh(runs, "--nodes", "2", "--epochs", "1000", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert wait_until(lambda: (runs / "latest").exists() and training((runs / "latest").resolve()), 60)
        run_dir = (runs / "latest").resolve()
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground process
        out, _ = proc.communicate(timeout=60)
    finally:
        reap(proc, runs)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "SIGINT: stopping 2 nodes" in out and "SIGKILL to" not in out
    for name in ("w1", "w2"):
        assert metrics(run_dir, name)[-1]["reason"] == "stopped by SIGTERM"
    assert alive(runs) == []
    assert (run_dir / "curves.png").exists()
