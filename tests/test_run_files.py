"""Tools that read run-folder files skip and report a bad line, and never crash (issue 28, item 8).

One metrics file holds what a corrupted disk, a killed node or a hostile writer leaves: a loss that is
an object, a line cut short, bytes that are not UTF-8, a line of 10 MB, and a last line without its
newline. ``python -m dpwa plot``, ``python -m dpwa status RUN_DIR``, the launcher's live view
(MetricsTail) and the dashboard (RunWatcher, and /api/state) each report every bad line with its file
and line number, and go on with the good ones. They all parse lines in one place:
dpwa.cluster.events.parse_line / JsonlFollower, with check_metrics.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, make_config, wait_until
from dpwa import cli
from dpwa.cluster.dashboard import Dashboard
from dpwa.cluster.events import MAX_REPORTS, JsonlFollower, check_metrics, parse_line, read_jsonl
from dpwa.cluster.monitor import LiveView, MetricsTail
from dpwa.cluster.observe import EventBoard, RunWatcher
from dpwa.cluster.plot import draw, load_metrics

PNG = b"\x89PNG\r\n\x1a\n"
BIG = 10 * 1000 * 1000  # the 10 MB line


def line(**fields) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def write_bad_run(tmp_path: Path) -> Path:
    """A run folder of nodes w1 (its metrics file holds every kind of bad line) and w2 (all good)."""
    run_dir = tmp_path / "run"
    for sub in ("metrics", "pids", "logs"):
        (run_dir / sub).mkdir(parents=True)
    config = make_config(2)
    for node, name in zip(config["nodes"], ("w1", "w2"), strict=True):
        node["name"] = name
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    w1 = b"".join(
        [
            line(kind="start", t=100.0, node="w1", epochs=2),  # 1
            line(kind="step", t=101.0, node="w1", epoch=1, step=5, loss=2.0),  # 2
            b'{"kind": "step", "t": 102.0, "node": "w1", "ep\n',  # 3: cut short
            b'{"kind": "step", "t": 103.0, "node": "w1", "error": "\xff\xfe"}\n',  # 4: not UTF-8
            b'{"kind": "step", "t": 104.0, "pad": "' + b"x" * BIG + b'"}\n',  # 5: 10 MB
            line(kind="step", t=106.0, node="w1", epoch=2, step=15, loss=1.0),  # 6
            line(kind="eval", t=107.0, node="w1", epoch=2, test_acc=0.75),  # 7
            line(kind="step", t=108.0, node="w1", epoch=2, step=20, loss={"a": 1}),  # 8: the line
            b'{"kind": "step", "t": 109.0, "node": "w1", "loss"',  # 9: no newline: the writer was killed
        ]
    )
    (run_dir / "metrics" / "w1.jsonl").write_bytes(w1)
    (run_dir / "metrics" / "w2.jsonl").write_bytes(
        line(kind="start", t=100.5, node="w2", epochs=2) + line(kind="step", t=101.5, node="w2", step=5, loss=3.0)
    )
    for name in ("w1", "w2"):
        (run_dir / "pids" / f"{name}.pid").write_text("999999999 1\n")  # no such process
    return run_dir


# What every reader says of w1.jsonl (line 9 only when it reads the file as finished).
EXPECTED = {
    3: "not JSON: Unterminated string starting at (column 44); cut short, or not written by dpwa",
    4: "not UTF-8 text (byte 0xff at byte 54)",
    5: f"{BIG + 39} bytes, longer than the 1048576 a line may have",
    8: "loss is an object, not a number",
}
LAST = {9: "no newline at its end (cut short, or still being written): not JSON: "}


def assert_reported(said: list[str], path: Path, expected: dict[int, str]) -> None:
    """Every expected line is named once, with its file and number; nothing else is."""
    for number, reason in expected.items():
        hits = [s for s in said if f"{path}: line {number}: {reason}" in s and s.rstrip().endswith("; skipped")]
        assert len(hits) == 1, (number, reason, said)
    assert len(said) == len(expected), said


# --------------------------------------------------------------------------- the one parser


def test_parse_line_says_what_is_wrong():
    assert parse_line(b'{"kind": "step", "t": 1, "loss": 0.5}', check=check_metrics) == {
        "kind": "step",
        "t": 1,
        "loss": 0.5,
    }
    assert parse_line(b"  ") == ""  # a blank line: nothing to report
    diverged = parse_line(b'{"t": 1, "kind": "step", "loss": NaN}', check=check_metrics)
    assert isinstance(diverged, dict) and diverged["kind"] == "step"  # NaN is a number a diverging run writes
    cases = {
        b'{"kind": "step", "t": 1, "loss": {"a": 1}}': "loss is an object, not a number",
        b'{"kind": "step", "t": 1, "step": -3}': "step is -3, not a count (an integer from 0)",
        b'{"kind": "step", "t": 1, "peers": {"w2": "x"}}': "peers is an object, not an object of counts",
        b'{"kind": "step", "t": 1e400}': "t is inf, not a Unix time",
        b'{"kind": "step", "t": "soon"}': "t is a string, not a Unix time",
        b'{"kind": "step", "t": 1' + b"0" * 400 + b"}": "t is an integer of 401 digits, not a Unix time",
        b'{"kind": "step", "t": 1, "loss": 1' + b"0" * 400 + b"}": "loss is an integer of 401 digits, not a number",
        b'{"kind": "step"}': "t (the time) is missing",
        b'{"kind": 7, "t": 1}': "kind is a number, not a string",
        b"[1, 2]": "a list, not a JSON object",
        b'"x"': "a string, not a JSON object",
        b"[" * 100_000: "not JSON",
        b'{"t": 1, "kind": "step", "step": ' + b"9" * 5000 + b"}": "not JSON that can be read",
        b'{"t": 1, "kind": "\xc3"}': "not UTF-8 text (byte 0xc3 at byte 19)",
    }
    for raw, reason in cases.items():
        got = parse_line(raw, max_line_bytes=1 << 20, check=check_metrics)
        assert isinstance(got, str) and got.startswith(reason), (raw[:40], got)
    assert parse_line(b"{}" + b" " * 100, max_line_bytes=50) == "102 bytes, longer than the 50 a line may have"


def test_the_follower_numbers_lines_across_chunks_and_reports_a_few_per_file(tmp_path):
    path = tmp_path / "m.jsonl"
    text = b"".join(line(kind="step", t=float(i), step=i) for i in range(3))
    text += b'{"pad": "' + b"y" * 300 + b'"}\n'  # line 4: too long, read over several chunks
    text += line(kind="step", t=9.0, step=9)  # line 5
    text += b"oops\n" * 25  # lines 6..30
    text += line(kind="step", t=10.0, step=10)  # line 31
    path.write_bytes(text)
    follower = JsonlFollower(path, chunk_bytes=16, max_line_bytes=100, check=check_metrics)
    records = []
    for _ in range(200):
        records += follower.poll()
        if follower.at_end:
            break
    assert [r["step"] for r in records] == [0, 1, 2, 9, 10]
    problems = follower.take_problems()
    assert [p.line for p in problems] == [4] + list(range(6, 6 + MAX_REPORTS - 1))
    assert problems[0].reason == "311 bytes, longer than the 100 a line may have"
    assert "later bad lines of this file are only counted" in problems[-1].reason
    assert follower.bad_lines == 26 and follower.line == 31 and follower.take_problems() == []


def test_read_jsonl_takes_a_whole_last_line_and_reports_a_cut_one(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(line(kind="step", t=1.0) + b'{"kind": "end", "t": 2.0}')
    records, reader = read_jsonl(path, check_metrics)
    assert [r["kind"] for r in records] == ["step", "end"] and reader.bad_lines == 0
    path.write_bytes(line(kind="step", t=1.0) + b'{"kind": "end", "t": 2.')
    records, reader = read_jsonl(path, check_metrics)
    assert [r["kind"] for r in records] == ["step"]
    (problem,) = [str(p) for p in reader.take_problems()]
    assert problem.startswith(f"{path}: line 2: no newline at its end (cut short, or still being written): not JSON: ")
    assert problem.endswith("; cut short, or not written by dpwa; skipped") and reader.bad_lines == 1


# --------------------------------------------------------------------------- each tool


@pytest.mark.slow
def test_python_m_dpwa_plot_reports_each_bad_line_and_draws_the_good_ones(tmp_path):
    run_dir = write_bad_run(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "dpwa", "plot", str(run_dir), "--out", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.strip() == str(tmp_path / "c.png") and (tmp_path / "c.png").read_bytes()[:8] == PNG
    said = [s for s in done.stderr.splitlines() if s.startswith("dpwa plot: ")]
    assert_reported(said, run_dir / "metrics" / "w1.jsonl", {**EXPECTED, **LAST})


@pytest.mark.io
def test_plot_draws_exactly_the_good_lines(tmp_path):
    run_dir = write_bad_run(tmp_path)
    said = []
    metrics = load_metrics(run_dir, report=lambda problem: said.append(str(problem)))
    assert [(r["kind"], r["t"]) for r in metrics["w1"]] == [
        ("start", 100.0),
        ("step", 101.0),
        ("step", 106.0),
        ("eval", 107.0),
    ]
    assert [r["t"] for r in metrics["w2"]] == [100.5, 101.5]
    assert_reported(said, run_dir / "metrics" / "w1.jsonl", {**EXPECTED, **LAST})
    (run_dir / "summary.json").write_text("[" * 100_000)  # deeper than the JSON parser goes: no average line
    assert draw(run_dir, tmp_path / "c.png", report=lambda problem: None).read_bytes()[:8] == PNG


def test_status_of_a_run_folder_reports_each_bad_line_and_shows_the_table(tmp_path, capsys):
    run_dir = write_bad_run(tmp_path)
    assert cli.main(["status", str(run_dir)]) == 0
    out, err = capsys.readouterr()
    rows = out.splitlines()
    assert rows[1].split()[:5] == ["w1", "training", "2/2", "15", "1.0000"] and "75.00%" in rows[1]
    assert rows[2].split()[:5] == ["w2", "training", "0/2", "5", "3.0000"]
    assert rows[-1] == "running: nothing"
    said = [s for s in err.splitlines() if s.startswith("dpwa status: ")]
    assert_reported(said, run_dir / "metrics" / "w1.jsonl", {**EXPECTED, **LAST})


def test_the_monitor_reports_each_bad_line_once_above_its_table(tmp_path):
    run_dir = write_bad_run(tmp_path)
    tail = MetricsTail(run_dir, ["w1", "w2"])
    nodes = tail.poll()  # a live reader: line 9 may still be being written, so it waits
    w1 = nodes["w1"]
    assert w1.step is not None and w1.step["t"] == 106.0
    assert w1.eval is not None and w1.eval["test_acc"] == 0.75
    assert w1.bad_lines == 4
    screen = io.StringIO()
    view = LiveView(screen, tty=False, every_s=3600)
    view.update(list(nodes.values()), force=True)
    view.update(list(tail.poll().values()), force=True)  # nothing new: nothing said again
    said = [s for s in screen.getvalue().splitlines() if s.startswith("dpwa: ")]
    assert_reported(said, run_dir / "metrics" / "w1.jsonl", EXPECTED)
    assert "w1" in screen.getvalue().splitlines()[-2]  # the table follows
    with open(run_dir / "metrics" / "w1.jsonl", "ab") as fh:  # the writer finishes line 9
        fh.write(b': 0.5}\n{"kind": "eval", "t": 110.0, "test_acc": "high"}\n')
    nodes = tail.poll()
    step = nodes["w1"].step
    assert step is not None and step["t"] == 109.0 and nodes["w1"].bad_lines == 5
    assert [str(p) for p in nodes["w1"].problems] == [
        f"{run_dir / 'metrics' / 'w1.jsonl'}: line 10: test_acc is a string, not a number; skipped"
    ]


@pytest.mark.io
def test_the_dashboard_reports_each_bad_line_as_an_event_and_serves_the_good_ones(tmp_path):
    run_dir = write_bad_run(tmp_path)
    with open(run_dir / "events.jsonl", "wb") as fh:
        fh.write(line(t=100.2, kind="node_start", node="w1", pid=4, restart=0) + b'{"t": "soon", "kind": "kill"}\n')
    (run_dir / "summary.json").write_text("[" * 100_000)  # deeper than the JSON parser goes: not read
    board = EventBoard()
    watcher = RunWatcher(run_dir, ["w1", "w2"], board)
    for _ in range(30):  # 1 MB a poll: the 10 MB line takes about 11
        watcher.poll()
        if watcher.nodes["w1"].follower.at_end:
            break
    snap = watcher.snapshot()
    assert snap["summary"] is None
    assert snap["curves"]["loss"]["nodes"]["w1"] == [(101.0, 2.0), (106.0, 1.0)]
    assert snap["nodes"]["w1"]["bad_lines"] == 4 and snap["nodes"]["w2"]["bad_lines"] == 0
    bad = [e for e in board.snapshot() if e["kind"] == "bad_line"]
    assert [e["node"] for e in bad] == [None] + ["w1"] * 4
    assert bad[0]["text"] == (
        "events.jsonl: line 2: t is a string, not a Unix time (a finite number within ±1e+12 s); skipped"
    )
    said = [f"{run_dir}/{e['text']}" for e in bad[1:]]
    assert_reported(said, run_dir / "metrics" / "w1.jsonl", EXPECTED)

    # and end to end: what the page gets from /api/state
    with Dashboard(run_dir, timeout_s=0.3, every_s=0.1) as dashboard:

        def state() -> dict:
            with urllib.request.urlopen(dashboard.url + "api/state", timeout=10) as response:
                return json.loads(response.read())

        deadline = time.monotonic() + 30
        assert wait_until(lambda: state()["run"]["nodes"]["w1"].get("bad_lines") == 4, 30)
        assert time.monotonic() < deadline
        got = state()
        assert sum(e["kind"] == "bad_line" for e in got["events"]) == 5
        assert got["run"]["curves"]["loss"]["nodes"]["w1"] == [[101.0, 2.0], [106.0, 1.0]]
