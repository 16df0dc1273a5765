"""python -m dpwa run (and ./run.sh -- ...): a script of the user's own, once per node of a local cluster.

The script (tests/helpers/gossip_script.py, or examples/minimal.py) has no dpwa options: it finds its
config, name and run folder in the environment, and gossip_optimizer writes its metrics lines, so the
launcher's live table, summary and chaos mode treat it as they treat the example. Every process started
is found through the run folder's PID files and killed by PID when a test ends (test_cluster.reap).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_cluster import alive, metrics, reap

from conftest import CHECKOUT_PATH, HELPERS, ROOT, wait_until
from dpwa.cluster import runner
from dpwa.runfiles.metrics import MetricsError, MetricsWriter

SCRIPT = HELPERS / "gossip_script.py"


def dpwa_run(runs: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dpwa", "run", "--runs-dir", str(runs), *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("DPWA_")},
            "PYTHONPATH": CHECKOUT_PATH,
            **(env or {}),
        },
    )


def finish(proc: subprocess.Popen, runs: Path, timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        reap(proc, runs)
    return out


class Output:
    """A launcher's output, read on a thread while the test waits for something else."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[str] = []
        stdout = proc.stdout
        assert stdout is not None
        self.reader = threading.Thread(target=lambda: self.lines.extend(stdout), daemon=True)
        self.reader.start()

    def text(self) -> str:
        return "".join(list(self.lines))

    def wait(self, timeout_s: float) -> str:
        self.proc.wait(timeout_s)
        self.reader.join(10)
        return self.text()


def every_node_killed_and_back(run_dir: Path, nodes: tuple[str, ...] = ("w1", "w2", "w3")) -> bool:
    """Chaos has killed each of `nodes` once, and each has started again and trained a step since."""
    events = run_dir / "events.jsonl"
    lines = events.read_text().splitlines() if events.exists() else []
    kills = {event["node"] for event in map(json.loads, lines) if event["kind"] == "kill"}
    if kills != set(nodes):
        return False
    for node in nodes:
        records = metrics(run_dir, node)
        starts = [i for i, r in enumerate(records) if r["kind"] == "start"]
        if len(starts) < 2 or not any(r["kind"] == "step" for r in records[starts[1] :]):
            return False
    return True


def results(run_dir: Path, marker: str) -> dict[str, dict]:
    """Each node's last ``marker {json}`` line of its log."""
    found = {}
    for log in sorted((run_dir / "logs").glob("w*.log")):
        lines = [line for line in log.read_text().splitlines() if line.startswith(marker + " ")]
        if lines:
            found[log.stem] = json.loads(lines[-1].split(" ", 1)[1])
    return found


@pytest.mark.io
def test_without_a_command_it_says_to_give_one_after_the_double_dash(tmp_path):
    proc = dpwa_run(tmp_path / "runs", "--nodes", "2")
    out = finish(proc, tmp_path / "runs", 60)
    assert proc.returncode == 2
    assert "give the command each node runs after '--'" in out
    assert not (tmp_path / "runs").exists()  # nothing started, no run folder


def test_a_command_without_the_double_dash_is_shown_with_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        runner.main(["--nodes", "2", "python", "train.py", "--lr", "0.1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "goes after '--': python -m dpwa run --nodes 2 -- python train.py --lr 0.1" in err
    with pytest.raises(SystemExit):
        runner.main(["--nodez", "2", "--", "python", "x.py"])  # a typo before '--' is just that
    assert capsys.readouterr().err.strip().endswith("unrecognized arguments: --nodez 2")


@pytest.mark.io
def test_the_example_launcher_names_the_double_dash_when_it_meets_a_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pytorch-cifar" / "cluster.py"), "main.py"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "-- COMMAND" in proc.stderr and "unrecognized arguments: main.py" in proc.stderr


def test_each_node_gets_its_config_name_and_run_folder_in_its_environment():
    spec_env = runner.NODE_ENV
    assert spec_env == {"DPWA_CONFIG": "{config}", "DPWA_NAME": "{name}", "DPWA_RUN_DIR": "{run_dir}"}


def test_the_metrics_writer_refuses_a_line_that_does_not_fit_the_schema(tmp_path):
    with MetricsWriter(tmp_path, "w1") as writer:
        writer.write("step", step=3, loss=0.5, peers={"w2": 1})
        with pytest.raises(MetricsError, match=r"step missing \(a 'step' line needs step\)"):
            writer.write("step", loss=0.5)
        with pytest.raises(MetricsError, match="averaged is -1, not a count"):
            writer.write("step", step=4, averaged=-1)
        with pytest.raises(MetricsError, match="loss is a string, not a number"):
            writer.write("eval", step=4, loss="low")
        with pytest.raises(MetricsError, match="not JSON"):
            writer.write("custom", value=object())
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "w1.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["node"]) for r in lines] == [("step", 3, "w1")]  # the refused ones: none
    assert (tmp_path / "metrics" / "w1.jsonl").stat().st_mode & 0o777 == 0o600


def test_outside_a_run_folder_the_writer_writes_nothing_but_still_checks():
    writer = MetricsWriter.from_env("w1", environ={})
    assert not writer.enabled
    writer.write("eval", step=1, test_loss=0.3)
    with pytest.raises(MetricsError):
        writer.write("end")  # no reason


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_script_of_your_own_runs_on_the_cluster_and_shows_in_its_table(tmp_path):
    """./run.sh --nodes 2 -- python examples/minimal.py, word for word, with a PATH whose first ``python`` has
    no torch (a bare virtual environment, as a fresh machine's system Python): the nodes run .venv's python
    (issue 42: before, they ran the first python on the PATH and failed at ``import torch``). Both nodes
    found their names (w1, w2), ranks 0 and 1 of 2, averaged, and wrote start, step and end lines that the
    live table and the summary show."""
    import venv

    runs = tmp_path / "runs"
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)  # its python has no torch, no dpwa
    assert subprocess.run([str(bare / "bin" / "python"), "-c", "import torch"], capture_output=True).returncode != 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPWA_")}
    env["PATH"] = os.pathsep.join([str(bare / "bin"), env.get("PATH", "")])
    proc = subprocess.Popen(
        [
            str(ROOT / "run.sh"),
            "--runs-dir",
            str(runs),
            "--nodes",
            "2",
            "--print-every",
            "1",
            "--",
            "python",
            "examples/minimal.py",
        ],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    out = finish(proc, runs, 120)
    assert proc.returncode == 0, out
    assert f"dpwa: the nodes run python = {ROOT / '.venv' / 'bin' / 'python'}" in out, out
    run_dir = (runs / "latest").resolve()
    found = results(run_dir, "minimal-result")
    assert sorted(found) == ["w1", "w2"], out
    assert {(r["name"], r["rank"], r["world_size"]) for r in found.values()} == {("w1", 0, 2), ("w2", 1, 2)}
    assert all(r["averaged"] > 0 and r["last_loss"] < r["first_loss"] for r in found.values()), found
    for node in ("w1", "w2"):
        kinds = [r["kind"] for r in metrics(run_dir, node)]
        assert kinds[0] == "start" and kinds[-1] == "end" and "step" in kinds, kinds
        assert metrics(run_dir, node)[-1]["reason"] == "done"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [n["node"] for n in summary["nodes"]] == ["w1", "w2"]
    assert all(n["state"] == "done" and n["averaged"] > 0 for n in summary["nodes"]), summary
    assert "w1    done" in out and "w2    done" in out  # the live table's last rows
    assert (run_dir / "curves.png").stat().st_size > 0
    # what the dashboard draws from the run folder: each node's loss curve, and the mixing between them
    from dpwa.cluster.observe import EventBoard, RunWatcher

    watcher = RunWatcher(run_dir, ["w1", "w2"], EventBoard())
    watcher.poll()
    board = watcher.snapshot()
    curves = board["curves"]["loss"]["nodes"]
    assert set(curves) == {"w1", "w2"} and all(len(points) >= 2 for points in curves.values()), curves
    assert {name: node["state"] for name, node in board["nodes"].items()} == {"w1": "done", "w2": "done"}
    assert alive(runs) == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_chaos_kills_a_script_of_your_own_and_the_restarted_process_rejoins(tmp_path):
    """python -m dpwa run --nodes 3 --chaos 1 --restarts 1 -- python gossip_script.py: the launcher kills
    training nodes and starts them again; each restarted process joins the cluster from a live peer (its
    start line says so), every node ends done, and the summary counts as many rejoins as kills.

    The nodes train until the test writes their stop file (STEPS is only a ceiling), and it writes it once
    chaos has killed every node (with --restarts 1 no node can be killed twice: no kill can come after) and
    each has trained again since its restart: so every restarted process met peers still training."""
    runs, stop = tmp_path / "runs", tmp_path / "stop"
    proc = dpwa_run(
        runs,
        "--nodes",
        "3",
        "--chaos",
        "1",
        "--chaos-seed",
        "2",
        "--restarts",
        "1",
        "--print-every",
        "2",
        "--",
        sys.executable,
        str(SCRIPT),
        env={"STEPS": "1000000", "STOP_FILE": str(stop)},  # the ceiling: far past the test's deadline
    )
    output = Output(proc)
    try:
        assert wait_until(lambda: (runs / "latest").exists(), 60), output.text()
        run_dir = (runs / "latest").resolve()
        assert wait_until(lambda: every_node_killed_and_back(run_dir), 120, interval_s=0.2), output.text()
        stop.touch()
        out = output.wait(60)
    finally:
        reap(proc, runs)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["kills"] == 3 and summary["restarts"] == summary["kills"], summary
    assert summary["rejoins"] == summary["kills"], summary
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    killed = [e["node"] for e in events if e["kind"] == "kill"]
    assert sorted(killed) == ["w1", "w2", "w3"], killed
    for node in killed:
        starts = [r for r in metrics(run_dir, node) if r["kind"] == "start"]
        assert len(starts) == 2 and starts[1]["started"].startswith("joined the cluster from w"), starts
        assert starts[1]["clock"] > 0  # it took a trained peer's state, not a fresh one
    found = results(run_dir, "script-result")
    assert sorted(found) == ["w1", "w2", "w3"], out
    for name, result in found.items():
        assert result["env"]["DPWA_NAME"] == name and result["env"]["DPWA_RUN_DIR"] == str(run_dir)
        assert result["env"]["DPWA_CONFIG"] == str(run_dir / "config.yaml")
        assert result["stopped_by"] == "stop file", result  # still training when the last one rejoined
    assert all(metrics(run_dir, n)[-1]["reason"] == "done" for n in ("w1", "w2", "w3"))
    assert alive(runs) == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resume_runs_the_same_command_again_in_the_same_folder(tmp_path):
    """python -m dpwa run --resume RUN_DIR: the command the run was started with, in its folder, each node with
    its name and DPWA_RESUME=1; a command given with --resume is refused (the run's own is what resumes)."""
    runs = tmp_path / "runs"
    first = dpwa_run(runs, "--nodes", "2", "--", sys.executable, str(SCRIPT), env={"STEPS": "40"})
    out = finish(first, runs, 120)
    assert first.returncode == 0, out
    run_dir = (runs / "latest").resolve()
    again = dpwa_run(runs, "--resume", str(run_dir), env={"STEPS": "40"})
    out = finish(again, runs, 120)
    assert again.returncode == 0, out
    assert f"running {sys.executable} {SCRIPT} again in {run_dir}" in out
    for node in ("w1", "w2"):
        lines = [
            line for line in (run_dir / "logs" / f"{node}.log").read_text().splitlines() if "script-result" in line
        ]
        assert len(lines) == 2, lines  # the log is appended to: both runs
        envs = [json.loads(line.split(" ", 1)[1])["env"] for line in lines]
        assert envs[0]["DPWA_RESUME"] is None and envs[1]["DPWA_RESUME"] == "1"
        assert envs[1]["DPWA_NAME"] == node and envs[1]["DPWA_RUN_DIR"] == str(run_dir)
        starts = [r for r in metrics(run_dir, node) if r["kind"] == "start"]
        assert len(starts) == 2
    refused = dpwa_run(runs, "--resume", str(run_dir), "--", "python", "other.py")
    out = finish(refused, runs, 60)
    assert refused.returncode == 2 and "leave out '-- python other.py'" in out
    assert alive(runs) == []


def test_the_nodes_run_the_launchers_own_environment_first_and_an_import_failure_is_one_line(tmp_path):
    """The launcher's interpreter folder goes first on the nodes' PATH (once), so a bare ``python`` or
    ``torchrun`` is the launcher's environment's; the launcher says in one line what the nodes run; an explicit
    path is run as given; a node that died of a missing module gets one line naming it and the interpreter."""
    from dpwa.cluster.launch import import_failure, interpreter_line, launcher_path

    here = str(Path(sys.executable).parent)
    path = launcher_path({"PATH": os.pathsep.join(["/usr/bin", here, "/bin"])})
    assert path.split(os.pathsep) == [here, "/usr/bin", "/bin"]
    assert interpreter_line([Path(sys.executable).name, "x.py"], path).startswith(
        f"dpwa: the nodes run {Path(sys.executable).name} = {here}"
    )
    assert interpreter_line(["/opt/py/bin/python", "x.py"], path) == "dpwa: the nodes run /opt/py/bin/python as given"
    assert "not on their PATH" in interpreter_line(["no-such-program-here"], path)
    log = tmp_path / "w1.log"
    log.write_text("Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'torch'\n")
    line = import_failure(log, ["/opt/py/bin/python", "x.py"], path)
    assert line is not None and line.startswith("failed at import: no module named 'torch' in /opt/py/bin/python")
    log.write_text("ValueError: something else\n")
    assert import_failure(log, ["python"], path) is None
