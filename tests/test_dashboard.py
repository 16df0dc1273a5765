"""python -m dpwa dashboard: the state it gathers, its HTTP server, the kill button, and the page in a real browser.

The browser is Debian's headless Chromium, driven with ``--dump-dom`` (the DOM after the
page's scripts ran). ./test.sh installs it when it runs as root with apt-get
(scripts/ensure-chromium.sh); without it the browser tests are skipped, saying why.
Every process a test starts is stopped by its PID.
"""

from __future__ import annotations

import html.parser
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, filled, make_config, port_is_free, wait_until
from dpwa import NumpyParams
from dpwa.cluster.dashboard import Dashboard
from dpwa.cluster.events import EventLog, JsonlFollower
from dpwa.cluster.observe import MAX_TEXT, EventBoard, RunWatcher, Series
from dpwa.cluster.processes import process_start, read_pid_file, write_pid_file

PAGE = ROOT / "dpwa" / "cluster" / "dashboard.html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed, so the page is not tested in a browser: ./test.sh installs Debian's "
    "chromium once when it runs as root with apt-get (scripts/ensure-chromium.sh); or apt-get install chromium",
)
# Text that would run a script if the page wrote it as markup. No '/' in the first: it is also a folder name.
HOSTILE_IMG = "<img src=x onerror=document.body.dataset.pwned=1>"
HOSTILE_SCRIPT = "<script>document.body.dataset.pwned=2</script>"


# --------------------------------------------------------------------------- helpers


def http(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request; HTTP errors are answers too."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read()


def write_run(tmp_path: Path, names=("w1", "w2"), **settings) -> Path:
    """A run folder with config.yaml for nodes `names` (none of them running) and empty metrics/ and pids/."""
    run_dir = tmp_path / "run"
    for sub in ("metrics", "pids", "logs"):
        (run_dir / sub).mkdir(parents=True)
    config = make_config(len(names), **settings)
    for node, name in zip(config["nodes"], names, strict=True):
        node["name"] = name
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


class DomRecorder(html.parser.HTMLParser):
    """The parts of a dumped DOM the tests read: every element's tag and attributes, the text of each
    node row's fields, and all text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.rows: dict[str, dict[str, str]] = {}
        self.texts: list[str] = []
        self.html = ""  # the DOM as Chromium serialized it
        self._row: str | None = None
        self._field: str | None = None
        self._stack: list[tuple[str, str | None]] = []  # (tag, svg id) of open elements

    def handle_starttag(self, tag, attrs):
        attributes = {k: v or "" for k, v in attrs}
        svg = attributes.get("id") if tag == "svg" else (self._stack[-1][1] if self._stack else None)
        attributes["_svg"] = svg or ""
        self.elements.append((tag, attributes))
        if tag == "tr" and "data-node" in attributes:
            self._row = attributes["data-node"]
            self.rows[self._row] = {}
        if tag == "td" and self._row is not None and "data-field" in attributes:
            self._field = attributes["data-field"]
            self.rows[self._row][self._field] = ""
        if tag not in ("br", "img", "meta", "input", "link", "hr"):
            self._stack.append((tag, svg))

    def handle_endtag(self, tag):
        while self._stack:
            open_tag, _ = self._stack.pop()
            if open_tag == tag:
                break
        if tag == "tr":
            self._row = None
        if tag == "td":
            self._field = None

    def handle_data(self, data):
        self.texts.append(data)
        if self._row is not None and self._field is not None:
            self.rows[self._row][self._field] += data

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [
            a for t, a in self.elements if t == tag and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]


def dump_dom(url: str, tmp_path: Path, budget_ms: int = 4000) -> DomRecorder:
    """The page's DOM after its scripts ran, from headless Chromium; parsed."""
    assert CHROMIUM is not None  # the tests that call this are skipped without it
    profile = tmp_path / f"chromium-{time.monotonic_ns()}"
    argv = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        url,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # Chromium and its helpers: the session this test started
            proc.wait(10)
    assert proc.returncode == 0 and "<html" in out, f"chromium failed ({proc.returncode}): {err[-2000:]}"
    dom = DomRecorder()
    dom.feed(out)
    dom.html = out
    return dom


def assert_no_markup_ran(dom: DomRecorder) -> None:
    """Nothing hostile became an element or ran: one script (the page's own), no img, body unmarked."""
    assert len(dom.find("script")) == 1
    assert dom.find("img") == []
    body = dom.find("body")[0]
    assert "data-pwned" not in body and "data-updated" in body, body  # the page rendered, nothing ran


# --------------------------------------------------------------------------- the page's source


def test_the_page_never_writes_data_as_markup():
    """The page builds its DOM with createElement and textContent only; no script from elsewhere."""
    page = PAGE.read_text()
    for sink in (
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
        "new Function",
        'src="http',
        'href="http',
    ):
        assert sink not in page, sink
    assert page.count("<script") == 1 and '<script nonce="{{NONCE}}">' in page


# --------------------------------------------------------------------------- files: bounded, checked


def test_event_log_is_bounded_and_says_so(tmp_path):
    with EventLog(tmp_path, max_events=4) as log:
        for i in range(10):
            log.write("exit", f"w{i}", code=i)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["exit", "exit", "exit", "truncated"]
    assert [line.get("node") for line in lines[:3]] == ["w0", "w1", "w2"] and lines[3]["limit"] == 4
    with EventLog(tmp_path, max_events=4) as again:  # a resumed run counts what is there
        again.write("exit", "w9", code=0)
        assert again.lost == 1
    assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 4


def test_follower_reads_complete_lines_within_its_bounds(tmp_path):
    path = tmp_path / "m.jsonl"
    follower = JsonlFollower(path, chunk_bytes=64, max_line_bytes=40)
    assert follower.poll() == []  # no file yet
    path.write_text('{"a": 1}\n[1, 2]\nnot json\n{"b": 2')
    assert follower.poll() == [{"a": 1}] and follower.bad_lines == 2  # the list and "not json"
    with open(path, "a") as fh:
        fh.write('}\n{"long": "' + "x" * 100 + '"}\n{"c": 3}\n')
    got = []
    for _ in range(10):  # 64 bytes a poll: the rest comes at the next polls
        got += follower.poll()
    assert got == [{"b": 2}, {"c": 3}] and follower.bad_lines == 3  # the long line skipped whole
    path.write_text('{"d": 4}\n')  # rewritten, shorter: read again from the start
    assert follower.poll() == [{"d": 4}]


def test_series_keeps_an_even_sample_of_a_long_curve():
    series = Series(max_points=10)
    for i in range(1000):
        series.add(float(i), float(i))
    times = [t for t, _ in series.points]
    assert 5 <= len(times) <= 10 and times[0] == 0.0 and times[-1] >= 800
    steps = {b - a for a, b in zip(times, times[1:], strict=False)}
    assert len(steps) == 1  # evenly spaced


def test_run_watcher_keeps_only_what_checks_out(tmp_path):
    """Metrics, events and summaries may hold anything: unknown names are dropped, numbers must be finite,
    text is cut, and the snapshot is valid JSON."""
    run_dir = write_run(tmp_path, names=("w1", "w2"))
    lines = [
        {"kind": "start", "t": 100.0, "epochs": 3, "started": "started from the beginning", "lr": 0.05},
        {"kind": "start", "t": 100.5, "epochs": 3, "started": "joined the cluster at epoch 1 from w2"},
        {"kind": "step", "t": 101.0, "epoch": 1, "step": 5, "loss": 2.0, "peers": {"w2": 3, HOSTILE_IMG: 9, "w1": 1}},
        {"kind": "step", "t": 102.0, "epoch": 1, "step": 10, "loss": float("nan"), "averaged": -4},
        {"kind": "step", "t": 103.0, "epoch": 1, "step": "many", "loss": 1e400},
        {"kind": "eval", "t": 104.0, "epoch": 1, "test_acc": 0.5},
        {"kind": "checkpoint_failed", "t": 105.0, "error": HOSTILE_SCRIPT + "y" * 1000},
        {"kind": "barrier", "t": 106.0, "name": "epoch", "waited_s": 3.5, "skipped": [HOSTILE_IMG, [1], {}]},
        {"kind": ["step"], "t": 106.5, "node": {"w1": 1}},
        {"t": "yesterday", "kind": "step", "loss": 7.0},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (run_dir / "metrics" / "w1.jsonl").write_text(text.replace("1e+400", "1e400"))
    (run_dir / "events.jsonl").write_text(
        json.dumps({"t": 103.5, "kind": "kill", "node": "w1", "pid": 42, "by": "chaos"})
        + "\n"
        + json.dumps({"t": 103.6, "kind": "kill", "node": HOSTILE_IMG, "pid": 43})
        + "\n"
        + json.dumps({"t": 103.7, "kind": "exit", "node": ["w1"], "code": "x"})
        + "\n"
        + json.dumps({"t": 103.8, "kind": {"a": 1}, "node": "w2"})
        + "\n"
    )
    (run_dir / "logs" / "w1.log").write_text("".join(f"line {i}\n" for i in range(40)) + HOSTILE_SCRIPT + "\n")
    (run_dir / "summary.json").write_text('{"average": {"test_acc": NaN, "models": 2}}')
    board = EventBoard()
    watcher = RunWatcher(run_dir, ["w1", "w2"], board)
    watcher.poll()
    snap = watcher.snapshot()
    json.dumps(snap, allow_nan=False)  # valid JSON: no NaN anywhere
    w1 = snap["nodes"]["w1"]
    assert w1["peers"] == {"w2": 3}  # the node itself and unknown names are dropped
    assert snap["curves"]["loss"]["nodes"]["w1"] == [(101.0, 2.0)]  # NaN and 1e400 are not points
    assert snap["curves"]["eval"] == {
        "metric": "test_acc",
        "nodes": {"w1": [(104.0, 0.5)], "w2": []},
        "average": [[104.0, 0.5]],
    }
    assert w1["log"][-1] == HOSTILE_SCRIPT and len(w1["log"]) == 12
    assert snap["summary"]["test_acc"] is None and snap["summary"]["models"] == 2
    events = board.snapshot()
    kinds = [(e["kind"], e["node"]) for e in events]
    assert (
        kinds
        == [("start", "w1"), ("rejoin", "w1"), ("kill", "w1"), ("checkpoint", "w1"), ("barrier", "w1")]
        + [("bad_line", None)] * 2
        + [("bad_line", "w1")] * 4
    )  # each skipped line is said, with its file and line (read after the rest)
    assert [e["text"] for e in events[5:7]] == [
        "events.jsonl: line 3: node is a list, not a string; skipped",
        "events.jsonl: line 4: kind is an object, not a string; skipped",
    ]
    assert events[7]["text"] == "metrics/w1.jsonl: line 4: averaged is -4, not a count (an integer from 0); skipped"
    assert w1["bad_lines"] == 4
    assert all(len(e["text"]) <= MAX_TEXT for e in events)
    assert events[3]["text"].startswith("checkpoint not saved: " + HOSTILE_SCRIPT)  # kept as text; the page escapes
    assert events[4]["text"] == "waited 3.5 s at barrier 'epoch'"  # the unknown name is not repeated


# --------------------------------------------------------------------------- the server


def test_state_never_waits_for_an_unreachable_node(tmp_path, nodes):
    """w1 runs, w2 never started: every GET answers at once, and w2 shows as unreachable with the reason."""
    run_dir = write_run(tmp_path, names=("w1", "w2"), fetch_probability=0)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    w1 = nodes(config, "w1", NumpyParams(filled(1)))
    w1.update_send(batch_size=4)
    w1.update_wait(loss=0.25)
    with Dashboard(run_dir, timeout_s=2.0, every_s=0.2) as board:
        slowest = 0.0

        def rows():
            nonlocal slowest
            t0 = time.monotonic()
            status, headers, body = http(board.url + "api/state")
            slowest = max(slowest, time.monotonic() - t0)
            assert status == 200 and headers["Content-Type"] == "application/json"
            return {row["name"]: row for row in json.loads(body)["status"]["rows"]}

        assert wait_until(lambda: len(rows()) == 2, 15)
        found = rows()
        assert found["w1"]["state"] == "training" and found["w1"]["clock"] == 4.0 and found["w1"]["loss"] == 0.25
        assert found["w1"]["peers"] == {"w2": {"score": 1.0, "failures": 0, "latency_s": None, "averaged": 0}}
        assert found["w2"]["state"] == "unreachable" and found["w2"]["reason"].startswith("timeout: ")
        assert slowest < 1.0, f"a request waited {slowest:.2f} s: it must not wait for a status round (2 s)"
        port = board.port
    assert port_is_free(port)
    assert not [t for t in threading.enumerate() if t.name.startswith("dpwa-dashboard")]


@pytest.mark.io
def test_the_page_is_served_with_a_fresh_nonce_and_strict_headers(tmp_path):
    with Dashboard(write_run(tmp_path)) as board:
        status, headers, body = http(board.url)
        _, again, _ = http(board.url)
        assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        policy = headers["Content-Security-Policy"]
        nonce = policy.split("'nonce-")[1].split("'")[0]
        assert f'<script nonce="{nonce}">' in body.decode() and nonce not in again["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
        assert headers["Referrer-Policy"] == "no-referrer" and headers["X-Content-Type-Options"] == "nosniff"
        assert http(board.url + "nope")[0] == 404
        assert http(board.url + "api/state", method="POST")[0] == 405
        # a page whose name was rebound to 127.0.0.1 (DNS rebinding) names another host
        status, _, body = http(board.url + "api/state", headers={"Host": f"evil.example:{board.port}"})
        assert status == 403 and "is not this dashboard's address" in json.loads(body)["error"]
        assert http(f"http://localhost:{board.port}/api/state")[0] == 200


def test_arguments_are_checked(tmp_path):
    run_dir = write_run(tmp_path)
    with pytest.raises(ValueError, match="only served on a loopback address"):
        Dashboard(run_dir, host="0.0.0.0", allow_kill=True)
    with pytest.raises(ValueError, match="needs a run folder"):
        Dashboard(run_dir / "config.yaml", allow_kill=True)
    with pytest.raises(FileNotFoundError, match="no such config file or run folder"):
        Dashboard(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        Dashboard(run_dir / "metrics")


@pytest.mark.slow
def test_python_m_dpwa_dashboard_prints_its_url_and_ctrl_c_stops_it(tmp_path):
    run_dir = write_run(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpwa", "dashboard", str(run_dir), "--allow-kill"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    stdout, stderr = proc.stdout, proc.stderr
    assert stdout is not None and stderr is not None
    try:
        first = stdout.readline()
        assert first.startswith("dpwa dashboard: http://127.0.0.1:") and "/?token=" in first, first
        url = first.split()[2]
        status, _, body = http(url.split("?")[0] + "api/state")
        assert status == 200 and json.loads(body)["kill"] is True and json.loads(body)["nodes"] == ["w1", "w2"]
        assert "keep it private" in stdout.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
        assert stderr.read() == ""  # no traceback
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        stdout.close()
        stderr.close()
    assert port_is_free(int(url.split(":")[2].split("/")[0]))


# --------------------------------------------------------------------------- the kill button


@pytest.fixture
def sleepers(tmp_path):
    """A run folder whose nodes w1, w2, w3 are `sleep` processes with PID files; all reaped by PID."""
    run_dir = write_run(tmp_path, names=("w1", "w2", "w3"))
    procs = {}
    for name in ("w1", "w2", "w3"):
        procs[name] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        write_pid_file(run_dir / "pids" / f"{name}.pid", procs[name].pid)
    yield run_dir, procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


@pytest.mark.io
def test_the_kill_button_kills_exactly_the_node_asked_by_its_pid(sleepers):
    run_dir, procs = sleepers
    with Dashboard(run_dir, allow_kill=True, timeout_s=0.3) as board:
        assert board.token is not None and board.url.endswith(f"/?token={board.token}") and len(board.token) >= 32
        kill = f"http://127.0.0.1:{board.port}/api/kill?node=w2&token={board.token}"
        status, _, body = http(kill, method="POST", headers={"Origin": f"http://127.0.0.1:{board.port}"})
        assert status == 200, body
        assert json.loads(body) == {"killed": "w2", "pid": procs["w2"].pid}
        assert procs["w2"].wait(10) == -signal.SIGKILL
        assert procs["w1"].poll() is None and procs["w3"].poll() is None
        again = http(kill, method="POST")
        assert again[0] == 409 and f"w2 (pid {procs['w2'].pid}) is not running" in json.loads(again[2])["error"]
        assert any(e["kind"] == "kill" and e["node"] == "w2" for e in board.events.snapshot())


@pytest.mark.io
def test_the_kill_button_refuses_everything_else(sleepers):
    run_dir, procs = sleepers
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (run_dir / "pids" / "w3.pid").write_text(f"{bystander.pid} 1\n")  # a stale file: its PID, another start
        with Dashboard(run_dir, allow_kill=True, timeout_s=0.3) as board:
            base = f"http://127.0.0.1:{board.port}/api/kill"

            def refused(query: str, method: str = "POST", **headers: str) -> tuple[int, str]:
                status, answer_headers, body = http(base + query, method=method, headers=headers)
                if status == 405:
                    assert answer_headers["Allow"] == "POST"
                return status, json.loads(body)["error"]

            token = board.token
            assert token is not None
            assert refused("?node=w1") == (403, "no token: open the URL the dashboard printed (it ends in ?token=...)")
            assert refused("?node=w1&token=" + "x" * len(token)) == (
                403,
                "wrong token: open the URL the dashboard printed",
            )
            assert refused(f"?node=w1&token={token}", method="GET")[0] == 405
            assert refused(f"?node=w1&token={token}", Origin="http://evil.example")[0] == 403
            assert refused(f"?node=w1&token={token}", Host=f"evil.example:{board.port}")[0] == 403
            assert refused(f"?node=w1&token={token}&token={token}")[0] == 400
            assert refused(f"?token={token}") == (400, "which node? give ?node=NAME")
            status, error = refused(f"?node=launcher&token={token}")  # never anything but a node of the run
            assert status == 404 and "no node 'launcher'" in error
            status, error = refused(f"?node=w3&token={token}")
            assert status == 409 and "is not running" in error  # the stale PID file's process is not ours
            assert bystander.poll() is None
        with Dashboard(run_dir, timeout_s=0.3) as off:  # not started with allow_kill
            status, _, body = http(f"http://127.0.0.1:{off.port}/api/kill?node=w1&token={token}", method="POST")
            assert status == 404 and "start the dashboard with --allow-kill" in json.loads(body)["error"]
            assert off.token is None and "token" not in off.url
        assert all(p.poll() is None for p in procs.values())  # nothing was killed
    finally:
        bystander.kill()
        bystander.wait(10)


# --------------------------------------------------------------------------- in a real browser


@needs_chromium
@pytest.mark.timeout(120)
@pytest.mark.io
def test_the_page_shows_hostile_names_and_text_as_text(tmp_path):
    """A state whose node names, reasons, events and log lines are markup: the page shows each as text."""
    run_dir = write_run(tmp_path, names=("w1", "w2"))
    with Dashboard(run_dir, timeout_s=0.3) as board:
        state = board.state()
        state.update(
            nodes=[HOSTILE_SCRIPT, "w2"],
            local=[HOSTILE_SCRIPT, "w2"],
            status={
                "asked_at": time.time(),
                "asked_as": "w2",
                "error": None,
                "rows": [
                    {"name": HOSTILE_SCRIPT, "state": "unreachable", "reason": HOSTILE_IMG},
                    {
                        "name": "w2",
                        "state": "training",
                        "epoch": 1,
                        "clock": 5.0,
                        "loss": 0.5,
                        "exchanges_per_s": 2.0,
                        "averaged": 3,
                        "failures": 0,
                        "bytes_in": 4000,
                        "bytes_out": 4000,
                        "served": 3,
                        "pending": 0,
                        "uptime_s": 9.0,
                        "barriers": {},
                        "peers": {HOSTILE_SCRIPT: {"score": 1.0, "failures": 0, "latency_s": 0.01, "averaged": 3}},
                    },
                ],
            },
            events=[{"t": time.time(), "kind": "kill", "node": HOSTILE_SCRIPT, "text": HOSTILE_IMG}],
        )
        state["run"]["nodes"] = {
            HOSTILE_SCRIPT: {"state": "training", "log": [HOSTILE_IMG], "peers": {"w2": 2}},
            "w2": {"state": "training", "log": [], "peers": {}},
        }
        state["run"]["curves"]["loss"]["nodes"] = {HOSTILE_SCRIPT: [[time.time() - 5, 2.0], [time.time(), 1.0]]}
        board.state = lambda: state  # type: ignore[method-assign]  # what /api/state serves from now on
        dom = dump_dom(board.url, tmp_path)
    assert_no_markup_ran(dom)
    assert dom.rows[HOSTILE_SCRIPT]["name"] == HOSTILE_SCRIPT  # the name, as text, in its row
    assert HOSTILE_IMG in dom.rows[HOSTILE_SCRIPT]["state"]  # the unreachable reason
    assert HOSTILE_SCRIPT in dom.rows["w2"]["peers"]
    texts = "".join(dom.texts)
    assert texts.count(HOSTILE_IMG) >= 3  # the reason, the event, the log line
    assert dom.find("path", data_series=HOSTILE_SCRIPT) and dom.find("g", data_graph_node=HOSTILE_SCRIPT)
    assert dom.find("line", data_edge=f"w2->{HOSTILE_SCRIPT}")
    assert "&lt;script&gt;" in dom.html and "&lt;img src=x" in dom.html  # serialized as text


def node_numbers(dom: DomRecorder, name: str) -> tuple[str, ...]:
    row = dom.rows[name]
    return tuple(row[k] for k in ("state", "clock", "step", "uptime_s"))


@needs_chromium
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_sh_dashboard_shows_a_live_3_node_run_with_chaos_in_a_browser(tmp_path):
    """./run.sh --dashboard --chaos, in a run folder whose path holds markup. Once chaos has killed each
    node once and each has rejoined, the page (two snapshots) shows every node with numbers that change,
    draws loss and accuracy curves per node and for the average, marks each kill and rejoin, and shows
    the hostile path and hostile log and metrics text as text. The kill button then kills exactly w2, by
    its PID; at Ctrl-C the dashboard stops with the cluster."""
    from test_cluster import metrics, reap
    from test_lifecycle import Foreground

    runs = tmp_path / HOSTILE_IMG / "runs"
    run = Foreground(
        runs,
        "--nodes",
        "3",
        "--epochs",
        "300",
        "--dashboard",
        "--allow-kill",
        "--chaos",
        "2",
        "--chaos-seed",
        "1",
        "--restarts",
        "1",
        "--print-every",
        "5",
    )
    try:

        def url() -> str | None:
            lines = [line for line in list(run.out) if line.startswith("dpwa: dashboard: http://")]
            return lines[0].split()[2] if lines else None

        assert wait_until(lambda: url() is not None, 60), "".join(run.out)
        printed = url()
        assert printed is not None and "token" not in printed  # the launcher never prints the kill token
        port = int(printed.split(":")[2].split("/")[0])
        run_dir = (runs / "latest").resolve()
        page = json.loads((run_dir / "dashboard.json").read_text())["url"]  # the token's one place (0600)
        assert page.startswith(printed + "?token=")
        events = run_dir / "events.jsonl"

        def chaos_done() -> bool:  # each node killed once (restarts 1: no more kills) and back to training
            kills = [json.loads(line) for line in events.read_text().splitlines() if '"kill"' in line]
            rejoined = [
                n
                for n in ("w1", "w2", "w3")
                if sum(r["kind"] == "start" for r in metrics(run_dir, n)) == 2
                and metrics(run_dir, n)[-1]["kind"] in ("step", "eval", "barrier", "checkpoint")
            ]
            return len(kills) == 3 and len(rejoined) == 3

        assert wait_until(chaos_done, 150, interval_s=0.5), "".join(run.out)
        with open(run_dir / "metrics" / "w3.jsonl", "a") as fh:
            fh.write(json.dumps({"kind": "checkpoint_failed", "t": time.time(), "error": HOSTILE_IMG}) + "\n")

        def state() -> str:
            return http(f"http://127.0.0.1:{port}/api/state")[2].decode()

        def hostile_log_line() -> None:
            """Append the hostile line to w1's log, and wait until the page's state has it: the page shows a
            log's last lines only, and w1 keeps writing, so it is written again before each snapshot."""
            with open(run_dir / "logs" / "w1.log", "a") as log:
                log.write(HOSTILE_SCRIPT + "\n")
            assert wait_until(lambda: "pwned=2" in state(), 15)

        def asked_at() -> float:
            return json.loads(state())["status"]["asked_at"] or 0.0

        def curves_drawn() -> bool:  # a node killed before its first evaluation has none until it evaluates twice
            curves = (json.loads(state())["run"] or {}).get("curves") or {}
            evals = (curves.get("eval") or {}).get("nodes") or {}
            losses = (curves.get("loss") or {}).get("nodes") or {}
            return all(len(c.get(n) or []) >= 2 for c in (evals, losses) for n in ("w1", "w2", "w3"))

        assert wait_until(curves_drawn, 60, interval_s=0.5)
        hostile_log_line()
        first = dump_dom(page, tmp_path)
        seen = asked_at()
        assert wait_until(lambda: asked_at() > seen + 1.5, 30)  # at least one more status round
        hostile_log_line()
        second = dump_dom(page, tmp_path)

        status, _, body = http(page.replace("/?token=", "/api/kill?node=w2&token="), method="POST")
        assert status == 200, body
        pid, start = read_pid_file(run_dir / "pids" / "w2.pid")
        assert json.loads(body) == {"killed": "w2", "pid": pid}
        assert wait_until(lambda: process_start(pid) != start, 10)
        others = [read_pid_file(run_dir / "pids" / f"{n}.pid") for n in ("w1", "w3")]
        assert all(process_start(p) == s for p, s in others)  # only w2

        run.proc.send_signal(signal.SIGINT)
        out = run.wait(60)
    finally:
        reap(run.proc, runs)
    for dom in (first, second):
        assert_no_markup_ran(dom)
        assert set(dom.rows) == {"w1", "w2", "w3"}
        texts = "".join(dom.texts)
        assert str(run_dir) in texts  # the hostile folder name, as text
        assert HOSTILE_SCRIPT in texts and HOSTILE_IMG in texts  # the log line, the metrics text
        for name in ("w1", "w2", "w3", "average"):
            for chart in ("loss-chart", "eval-chart"):
                paths = [p for p in dom.find("path", data_series=name) if p["_svg"] == chart]
                assert paths and int(paths[0]["data-points"]) >= 2, (name, chart)
        for mark in ("kill", "rejoin"):
            marked = {g["data-node"] for g in dom.find("g", data_mark=mark) if g["_svg"] == "loss-chart"}
            assert marked == {"w1", "w2", "w3"}, (mark, marked)
        assert len(dom.find("line")) > 0 and dom.find("g", data_graph_node="w1")
    for name in ("w1", "w2", "w3"):
        assert second.rows[name]["state"] in ("training", "at barrier")  # between steps, or at an epoch's end
        assert node_numbers(first, name) != node_numbers(second, name), name  # live numbers
        assert float(second.rows[name]["clock"]) > 0 and second.rows[name]["bytes_in"] != "0B"
    assert "dpwa: dashboard: http://127.0.0.1:" in out
    with pytest.raises(OSError):  # the dashboard stopped with the cluster
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_with_bootstrap_the_page_shows_the_members_status_found() -> None:
    """Open membership: members the config does not list show as the status rounds find them, and go with
    them; the config's own nodes always show. Without bootstrap, the config's nodes only."""
    from dpwa.cluster.dashboard import shown_names
    from dpwa.config import parse_config

    spec = {"name": "w1", "host": "127.0.0.1", "port": 45001}
    open_config = parse_config({"nodes": [spec], "bootstrap": ["127.0.0.1:45000"]})
    rows = [{"name": "w0", "state": "training"}, {"name": "w7", "state": "training"}, {"state": "?"}]
    assert shown_names(open_config, ["w1"], rows) == ["w0", "w1", "w7"]
    assert shown_names(open_config, ["w1"], rows[:1]) == ["w0", "w1"]  # w7 left the view
    assert shown_names(parse_config({"nodes": [spec]}), ["w1"], rows) == ["w1"]
