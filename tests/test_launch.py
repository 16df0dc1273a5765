"""The launcher (dpwa.cluster.launch, dpwa.cluster.processes) and the live view (dpwa.cluster.monitor), with stand-in nodes that need no torch."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import HELPERS, make_config, wait_until
from dpwa import ConfigError, load_config
from dpwa.cluster import launch, processes
from dpwa.cluster.monitor import LiveView, MetricsTail

FAKE = [sys.executable, str(HELPERS / "fake_node.py"), "{run_dir}", "{name}"]
AVERAGE = [
    sys.executable,
    "-c",  # some output, then the JSON line the launcher reads
    "import json; print('noise'); print(json.dumps({'models': 2, 'test_acc': 0.875, 'test_loss': 0.5}))",
]


def make_spec(tmp_path, modes, **kwargs):
    """A prepared spec for nodes w1.. whose fake_node modes are `modes`, e.g. ["finish", "fail"]."""
    config = make_config(len(modes))
    for i, node in enumerate(config["nodes"]):
        node["name"] = f"w{i + 1}"
    run_dir = launch.new_run_dir(tmp_path / "runs")
    by_name = json.dumps({f"w{i + 1}": mode for i, mode in enumerate(modes)})
    command = [
        sys.executable,
        "-c",
        "import json, os, sys; mode = json.loads(sys.argv[1])[sys.argv[3]]; "
        "os.execv(sys.argv[4], sys.argv[4:] + [mode])",
        by_name,
        "{run_dir}",
        "{name}",
    ] + FAKE
    spec = launch.LaunchSpec(
        run_dir=str(run_dir), config=config, command=command, grace_s=5, print_every_s=0.2, **kwargs
    )
    return launch.prepare(spec)


def log_says(spec, name, text):
    path = os.path.join(spec.run_dir, "logs", f"{name}.log")
    return os.path.exists(path) and text in open(path).read()


# --------------------------------------------------------------------------- ports, folders, PID files


@pytest.mark.io
def test_free_ports_are_distinct_and_bindable():
    ports = processes.free_ports(5)
    assert len(set(ports)) == 5
    processes.check_ports_free("127.0.0.1", ports)


@pytest.mark.io
def test_free_ports_skip_a_port_whose_ipc_endpoint_a_node_holds(tmp_path):
    """A loopback node listens on ipc://.../node-PORT, not on PORT: a port whose endpoint is locked by a
    live node is not free though nothing listens on it. Such a port is never handed out."""
    from dpwa.wire.endpoints import EndpointLock, ipc_endpoint

    held = []
    try:
        for port in processes.free_ports(3):  # three live claims on endpoints of ports free over TCP
            held.append((port, EndpointLock(ipc_endpoint(port))))
        drawn = {port for port, _ in held}
        real = socket.socket.getsockname
        calls = iter(sorted(drawn) + [0] * 100)

        def draw_claimed_first(sock):  # the kernel hands out the claimed ports first, then its own picks
            host, port = real(sock)
            wanted = next(calls)
            return (host, wanted or port)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(socket.socket, "getsockname", draw_claimed_first)
            ports = processes.free_ports(2)
        assert len(ports) == 2 and not drawn & set(ports)
    finally:
        for _, lock in held:
            lock.close()


@pytest.mark.io
def test_free_ports_come_from_the_range_dpwa_ports_names_and_skip_a_bound_one(monkeypatch):
    # Below the kernel's ephemeral range (in this worker's own range under xdist), where no connection of
    # anyone's takes a port by itself: the only bound port in the range is the one this test holds.
    mine = processes.port_range()
    with socket.socket() as held:
        for taken in range((mine[0] if mine else 23000) + 100, 32000, 7):
            try:
                held.bind(("127.0.0.1", taken))
                break
            except OSError:
                continue
        lo = taken - 2
        monkeypatch.setenv(processes.PORTS_ENV, f"{lo}-{lo + 5}")
        drawn = processes.free_ports(3) + processes.free_ports(2)
        assert len(set(drawn)) == 5, "successive draws of one process go on through the range"
        assert all(lo <= p <= lo + 5 for p in drawn) and taken not in drawn
        with pytest.raises(OSError, match=rf"DPWA_PORTS={lo}-{lo + 5}"):
            processes.free_ports(6)  # five free ports in a range of six, one of them bound


@pytest.mark.parametrize("text", ["20000", "20000-", "b-c", "900-2000", "3000-2000", "60000-70000"])
def test_a_dpwa_ports_range_that_is_not_lo_hi_is_refused_saying_what_is_expected(text):
    with pytest.raises(ValueError, match=r"\$DPWA_PORTS=.*expected LO-HI"):
        processes.port_range({processes.PORTS_ENV: text})
    assert processes.port_range({}) is None and processes.port_range({processes.PORTS_ENV: " "}) is None
    assert processes.port_range({processes.PORTS_ENV: "20000-20999"}) == (20000, 20999)


@pytest.mark.io
def test_a_busy_port_is_named_with_the_way_out():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(OSError, match=rf"port {port} on 127.0.0.1 is not free.*--base-port"):
            processes.check_ports_free("127.0.0.1", [port])


def test_each_run_gets_a_fresh_folder_and_latest_points_to_the_newest(tmp_path):
    first = launch.new_run_dir(tmp_path)
    second = launch.new_run_dir(tmp_path)  # within the same second: a suffix keeps them apart
    assert first != second and first.is_dir() and second.is_dir()
    assert (tmp_path / "latest").resolve() == second.resolve()


@pytest.mark.io
def test_a_pid_file_identifies_its_process_and_no_other(tmp_path):
    processes.write_pid_file(tmp_path / "me.pid", os.getpid())
    pid, start = processes.read_pid_file(tmp_path / "me.pid")
    assert pid == os.getpid() and processes.process_start(pid) == start
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert processes.process_start(child.pid) is None  # reaped: gone
    (tmp_path / "old.pid").write_text(f"{os.getpid()} 12345\n")  # our PID, another start time: a stale file
    pid, start = processes.read_pid_file(tmp_path / "old.pid")
    assert processes.process_start(pid) != start
    (tmp_path / "bad.pid").write_text("garbage")
    with pytest.raises(ValueError, match="bad.pid: expected 'PID START'"):
        processes.read_pid_file(tmp_path / "bad.pid")


# --------------------------------------------------------------------------- the spec


def test_placeholders_are_filled_and_the_spec_round_trips(tmp_path):
    spec = make_spec(tmp_path, ["finish", "finish"], finish_command=["eval", "{run_dir}"])
    argv = spec.argv(["x", "--name={name}", "{index}", "{config}", "{run_dir}/m"], "w2")
    assert argv == ["x", "--name=w2", "1", f"{spec.run_dir}/config.yaml", f"{spec.run_dir}/m"]
    assert spec.argv(spec.finish_command) == ["eval", spec.run_dir]
    assert launch.LaunchSpec.load(spec.run_dir) == spec
    config = load_config(os.path.join(spec.run_dir, "config.yaml"))
    assert [n.name for n in config.nodes] == ["w1", "w2"] and config.timeout_ms == 1000


def test_prepare_refuses_a_bad_config_or_an_unknown_local_node(tmp_path):
    config = make_config(2)
    config["nodes"][1]["port"] = 70000
    with pytest.raises(ConfigError, match=r"nodes\[1\].port must be an integer in 1..65535, got 70000"):
        launch.prepare(launch.LaunchSpec(run_dir=str(tmp_path), config=config, command=["x"]))
    with pytest.raises(ConfigError, match="no node named w9"):
        launch.prepare(launch.LaunchSpec(run_dir=str(tmp_path), config=make_config(2), command=["x"], local=["w9"]))


# --------------------------------------------------------------------------- running


@pytest.mark.slow
def test_a_run_to_the_end_writes_the_summary_and_the_curves(tmp_path):
    spec = make_spec(tmp_path, ["finish", "finish"], finish_command=AVERAGE)
    out = io.StringIO()
    assert launch.run(spec, out=out, tty=False) == 0
    summary = json.loads(Path(os.path.join(spec.run_dir, "summary.json")).read_text())
    rows = [(r["node"], r["state"], r["test_acc"], r["averaged"], r["failed"], r["served"]) for r in summary["nodes"]]
    assert rows == [("w1", "done", 0.5, 2, 1, 3), ("w2", "done", 0.75, 2, 1, 3)]
    assert summary["exchanges"] == 4 and summary["failed"] == 2
    assert summary["average"] == {"models": 2, "test_acc": 0.875, "test_loss": 0.5}
    text = out.getvalue()
    assert "average  2 nodes  87.50%" in text and "w1 <- w2 2; w2 <- w1 2" in text
    assert Path(os.path.join(spec.run_dir, "curves.png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("w1", "w2", "launcher"):
        pid, start = processes.read_pid_file(os.path.join(spec.run_dir, "pids", f"{name}.pid"))
        assert name == "launcher" or processes.process_start(pid) != start
    events = [json.loads(line) for line in Path(os.path.join(spec.run_dir, "events.jsonl")).read_text().splitlines()]
    kinds = [(e["kind"], e.get("node")) for e in events]
    assert kinds[:3] == [("run_start", None), ("node_start", "w1"), ("node_start", "w2")]
    assert sorted(kinds[3:5]) == [("exit", "w1"), ("exit", "w2")] and kinds[5:] == [("run_end", None)]
    assert events[0]["pid"] == os.getpid() and events[-1]["code"] == 0
    assert {e["node"]: e["pid"] for e in events if e["kind"] == "node_start"} == {
        n: processes.read_pid_file(os.path.join(spec.run_dir, "pids", f"{n}.pid"))[0] for n in ("w1", "w2")
    }
    assert all(e["code"] == 0 for e in events if e["kind"] == "exit")


@pytest.mark.slow
def test_a_failing_node_is_reported_with_the_end_of_its_log(tmp_path):
    spec = make_spec(tmp_path, ["finish", "fail"], finish_command=AVERAGE)
    out = io.StringIO()
    assert launch.run(spec, out=out, tty=False) == 1
    text = out.getvalue()
    assert "w2 exited with code 3" in text and "w2: something went wrong" in text
    assert "no final weights from w2" in text  # the average is not evaluated without every node's weights
    summary = json.loads(Path(os.path.join(spec.run_dir, "summary.json")).read_text())
    assert summary["nodes"][1]["state"] == "failed (3)"


@pytest.mark.slow
def test_stop_sends_sigterm_then_sigkill_to_a_node_that_ignores_it(tmp_path):
    spec = make_spec(tmp_path, ["wait", "stubborn"])
    cluster = processes.Cluster(spec.run_dir, {n: spec.argv(spec.command, n) for n in spec.names}, grace_s=5)
    try:
        cluster.start()
        assert wait_until(lambda: log_says(spec, "w1", "waiting") and log_says(spec, "w2", "waiting"), 30)
        assert cluster.stop(grace_s=0.5) == ["w2"]
    finally:
        cluster.signal(signal.SIGKILL)
    assert cluster.exited() == {"w1": 0, "w2": -signal.SIGKILL}
    end = Path(os.path.join(spec.run_dir, "metrics", "w1.jsonl")).read_text().splitlines()[-1]
    assert json.loads(end)["reason"] == "stopped by SIGTERM"


@pytest.mark.slow
def test_a_signal_to_the_launcher_stops_every_node_and_still_summarizes(tmp_path):
    spec = make_spec(tmp_path, ["wait", "wait"], finish_command=AVERAGE)

    def signal_once_both_wait():
        if wait_until(lambda: log_says(spec, "w1", "waiting") and log_says(spec, "w2", "waiting"), 30):
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_once_both_wait)
    sender.start()
    out = io.StringIO()
    try:
        code = launch.run(spec, out=out, tty=False)
    finally:
        sender.join()
    assert code == 128 + signal.SIGTERM
    text = out.getvalue()
    assert "SIGTERM: stopping 2 nodes" in text
    events = [json.loads(line) for line in Path(os.path.join(spec.run_dir, "events.jsonl")).read_text().splitlines()]
    assert [e for e in events if e["kind"] == "stop"][0]["signal"] == "SIGTERM"
    assert events[-1] == {**events[-1], "kind": "run_end", "code": 128 + signal.SIGTERM}
    assert "SIGKILL to" not in text  # both ended within the grace period
    summary = json.loads(Path(os.path.join(spec.run_dir, "summary.json")).read_text())
    assert [r["state"] for r in summary["nodes"]] == ["stopped", "stopped"]
    assert "the run was stopped" in summary["average"]["error"]


# --------------------------------------------------------------------------- the live view


def test_metrics_tail_reads_complete_lines_only(tmp_path):
    (tmp_path / "metrics").mkdir()
    path = tmp_path / "metrics" / "w1.jsonl"
    tail = MetricsTail(tmp_path, ["w1", "w2"])
    assert tail.poll()["w1"].state == "starting"  # no file yet
    line = json.dumps({"kind": "step", "t": 1.0, "node": "w1", "step": 7, "epoch": 2, "loss": 0.5})
    path.write_text('{"kind": "start", "t": 0.5, "node": "w1", "epochs": 3}\n' + line[:10])
    nodes = tail.poll()
    assert nodes["w1"].state == "training" and nodes["w1"].step is None
    with open(path, "a") as fh:
        fh.write(line[10:] + "\nnot json\n")
    nodes = tail.poll()
    assert nodes["w1"].step is not None and nodes["w1"].step["step"] == 7 and nodes["w1"].bad_lines == 1


def test_live_view_redraws_in_place_on_a_terminal_and_prints_lines_otherwise(tmp_path):
    nodes = list(MetricsTail(tmp_path, ["w1", "w2"]).poll().values())
    screen = io.StringIO()
    view = LiveView(screen, tty=True)
    view.update(nodes)
    view.update(nodes)
    view.message("hello")
    drawn = screen.getvalue()
    assert drawn.count("\x1b[4F\x1b[J") == 2  # header, two nodes, the elapsed line: erased before each redraw
    assert drawn.endswith("\x1b[4F\x1b[Jhello\n")
    plain = io.StringIO()
    view = LiveView(plain, tty=False, every_s=3600)
    view.update(nodes)
    assert plain.getvalue() == ""  # not due yet
    view.update(nodes, force=True)
    lines = plain.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[") and "w1" in lines[0] and "starting" in lines[0]
    assert "\x1b" not in plain.getvalue()


@pytest.mark.slow
def test_a_signal_during_the_average_evaluation_stops_that_too(tmp_path):
    slow_average = [sys.executable, "-c", "import time; time.sleep(60)"]
    spec = make_spec(tmp_path, ["finish", "finish"], finish_command=slow_average)
    finish_pid = os.path.join(spec.run_dir, "pids", "finish.pid")

    def signal_once_evaluating():
        if wait_until(lambda: os.path.exists(finish_pid), 30):
            os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_once_evaluating)
    sender.start()
    try:
        code = launch.run(spec, out=io.StringIO(), tty=False)
    finally:
        sender.join()
    assert code == 128 + signal.SIGTERM
    summary = json.loads(Path(os.path.join(spec.run_dir, "summary.json")).read_text())
    assert summary["average"] == {"error": "stopped during the evaluation"}
    pid, start = processes.read_pid_file(finish_pid)
    assert processes.process_start(pid) != start  # the evaluation process is gone too


class _FakeCluster:
    """What the supervisor uses of a Cluster: every node alive until killed, nothing restarted here."""

    def __init__(self, names):
        self.commands = dict.fromkeys(names)
        self.procs = {n: type("P", (), {"pid": 1000 + i})() for i, n in enumerate(names)}
        self.killed: list[str] = []

    def alive(self):
        return [n for n in self.commands if n not in self.killed]

    def kill(self, name):
        self.killed.append(name)
        return True

    def exited(self):
        return {}


def test_a_chaos_kill_that_falls_due_while_a_node_starts_waits_for_it_instead_of_being_dropped(tmp_path):
    """CI once ran a whole `--chaos 1.5` run without a kill: each time one fell due, some node was not yet
    training, and the kill was dropped for a new random wait. A due kill now stays due until every node
    trains, and comes at the first look after."""
    from dpwa.cluster.monitor import NodeState

    names = ["w1", "w2", "w3"]
    spec = launch.LaunchSpec(run_dir=str(tmp_path), config={}, command=[], restarts=2, chaos_s=1.5, chaos_seed=3)
    cluster = _FakeCluster(names)
    metrics = type("M", (), {"nodes": {n: NodeState(n) for n in names}, "poll": lambda self: self.nodes})()
    messages: list[str] = []
    view = type("V", (), {"message": lambda self, text: messages.append(text)})()
    events = type("E", (), {"write": lambda self, *a, **k: None})()
    supervisor = launch._Supervisor(spec, cluster, metrics, view, events)  # type: ignore[arg-type]
    for name in ["w1", "w2"]:  # w3 has started but logged no step yet
        metrics.nodes[name].start, metrics.nodes[name].step = {"t": 1.0}, {"t": 2.0}
    metrics.nodes["w3"].start = {"t": 1.0}
    supervisor.next_kill = 0.0  # due
    for _ in range(3):
        supervisor.kill_and_restart_due(stopping=False)
        assert cluster.killed == [] and supervisor.next_kill == 0.0  # not up: still due, nobody killed
    metrics.nodes["w3"].step = {"t": 3.0}
    supervisor.kill_and_restart_due(stopping=False)
    assert len(cluster.killed) == 1 and messages == [f"dpwa: chaos: SIGKILL to {cluster.killed[0]}"]
    assert metrics.nodes[cluster.killed[0]].kills == 1 and supervisor.next_kill > 0.0  # the next one drawn


def test_the_summary_of_a_script_that_evaluates_nothing_says_n_a_not_zero_epochs():
    """Issue 48: a callback script's summary showed `epochs 0` (it writes no eval lines). A node with no
    evaluation shows n/a there; one with its epoch's evaluation shows the epoch."""
    from dpwa.cluster.monitor import NodeState, format_summary, summarize

    script = NodeState(
        "w1", step={"step": 144, "averaged": 140, "failed": 0, "loss": 0.4321}, end={"step": 144, "averaged": 141}
    )
    example = NodeState("w2", eval={"epoch": 3, "test_acc": 0.9, "test_loss": 0.3}, end={"step": 66, "averaged": 60})
    summary = summarize([script, example], None, 10.0, "runs/x")
    assert [r["epochs"] for r in summary["nodes"]] == [None, 3]
    rows = {line.split()[0]: line.split() for line in format_summary(summary).splitlines() if line[:2] in ("w1", "w2")}
    assert rows["w1"][4] == "n/a" and rows["w2"][4] == "3" and rows["w1"][5] == "144"
    # what the script logged instead of an evaluation: its last training loss, in a note (w2 evaluated)
    assert "no evaluation from w1; last training loss: w1 0.4321" in format_summary(summary)
