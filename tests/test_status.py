"""python -m dpwa status CONFIG: every node asked over its own socket; one table, or JSON for scripts.

The nodes run in this process; the command runs as a child process, as a user runs it.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from conftest import ORIGINAL, ROOT, filled, make_config, secure_config, step_until_averaged, wait_until
from dpwa import NumpyParams, parse_config
from dpwa.cluster.status import FIELDS, StatusClient
from dpwa.gossip.reporting import STATUS, STATUS_REPORT, StatusServer
from dpwa.wire.schema import decode, encode
from dpwa.wire.server import Request

IDLE_PEER = {"score": 1.0, "failures": 0, "latency_s": None, "averaged": 0}  # a peer never fetched from


def dpwa_status(config_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "dpwa", "status", str(config_path), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


def write(tmp_path, cfg, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def by_name(done):
    assert done.stdout.count("\n") == 1, done.stdout  # one JSON document, one line
    return {row["name"]: row for row in json.loads(done.stdout)["nodes"]}


def steps(node, n, batch_size, loss):
    """n steps without fetches: the clock grows by batch_size each, the loss is the last one given."""
    for _ in range(n):
        assert not node.update_send(batch_size=batch_size)
        node.update_wait(loss=loss)


def test_json_gives_every_field_with_the_values_each_node_has(tmp_path, nodes):
    cfg = make_config(2, fetch_probability=0)  # no fetches: clocks and peers are known in advance
    w0 = nodes(cfg, "w0", NumpyParams(filled(0)))
    nodes(cfg, "w1", NumpyParams(filled(1)))
    steps(w0, 3, batch_size=4, loss=0.5)

    done = dpwa_status(write(tmp_path, cfg), "--json")
    assert done.returncode == 0, done.stderr
    assert list(json.loads(done.stdout)) == ["nodes"]
    rows = by_name(done)
    assert list(rows) == ["w0", "w1"]  # config order
    for row in rows.values():
        assert list(row) == list(FIELDS) and list(row)[:2] == ["name", "state"]
        assert row["state"] == "training" and row["epoch"] == 0 and row["barriers"] == {}
        assert row["averaged"] == row["failures"] == row["pending"] == 0 and row["exchanges_per_s"] == 0.0
        assert row["uptime_s"] > 0
    assert rows["w0"]["clock"] == 12.0 and rows["w0"]["loss"] == 0.5
    assert rows["w1"]["clock"] == 0.0 and rows["w1"]["loss"] is None
    assert rows["w0"]["peers"] == {"w1": IDLE_PEER} and rows["w1"]["peers"] == {"w0": IDLE_PEER}


def test_a_node_that_does_not_answer_is_unreachable_and_the_exit_status_says_so(tmp_path, nodes):
    cfg = make_config(3, fetch_probability=0)
    for k in (0, 1):  # w2 never starts
        nodes(cfg, f"w{k}", NumpyParams(filled(k)))
    path = write(tmp_path, cfg)

    done = dpwa_status(path, "--json", "--timeout-ms", 300)
    assert done.returncode == 1, done.stderr
    rows = by_name(done)
    assert [rows[n]["state"] for n in ("w0", "w1", "w2")] == ["training", "training", "unreachable"]
    assert set(rows["w2"]) == {"name", "state", "reason"} and rows["w2"]["reason"].startswith("timeout: ")

    table = dpwa_status(path, "--timeout-ms", 300)
    assert table.returncode == 1
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "node",
        "state",
        "epoch",
        "clock",
        "loss",
        "exch/s",
        "failed",
        "in",
        "out",
        "pending",
        "up",
    ]
    assert [line.split()[:2] for line in lines[1:4]] == [["w0", "training"], ["w1", "training"], ["w2", "unreachable"]]
    assert lines[1].split()[2:5] == ["0", "0.0", "-"]  # epoch, clock, loss
    assert "w0    w1 1.00/-  w2 1.00/-" in lines  # the peers section: score/last latency
    assert any(line.startswith("w2: unreachable: timeout: ") for line in lines)
    assert lines[-1].startswith("2 of 3 nodes answered at ") and lines[-1].endswith("(asked as w0)")


def test_bytes_through_shared_memory_count_and_so_do_each_peers_averages(tmp_path, nodes):
    """A loopback cluster moves parameters through shared memory: status counts those bytes too, on both
    sides, and each peer's number of averages (the dashboard's mixing graph)."""
    cfg = make_config(3, **ORIGINAL)  # loopback, no keys: ipc sockets, parameters through shared memory
    w1 = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(1)))
    w2 = nodes({**cfg, "fetch_probability": 0}, "w2", NumpyParams(filled(2)))
    for node in (w1, w2):
        node.update_send()
        node.update_wait()
    w0 = nodes(cfg, "w0", NumpyParams(filled(0)))
    averaged = {"w1": 0, "w2": 0}
    for _ in range(6):
        update = step_until_averaged(w0)
        assert update is not None
        averaged[update.peer] += 1
    assert w0.stats()["same_host_fetches"] == 6 and w0.stats()["bytes_in"] == 0  # no socket carried them
    rows = by_name(dpwa_status(write(tmp_path, cfg), "--json"))
    nbytes = filled(0).nbytes
    assert rows["w0"]["bytes_in"] == 6 * nbytes
    assert rows["w1"]["bytes_out"] == averaged["w1"] * nbytes and rows["w2"]["bytes_out"] == averaged["w2"] * nbytes
    assert {p: rows["w0"]["peers"][p]["averaged"] for p in ("w1", "w2")} == averaged
    assert rows["w1"]["peers"]["w0"]["averaged"] == 0  # w1 never blended w0's parameters
    table = dpwa_status(write(tmp_path, cfg)).stdout.splitlines()
    assert table[1].split()[7] == f"{6 * nbytes / 1000:.1f}kB"  # w0's "in"


def test_a_report_with_more_peers_than_fit_keeps_the_worst_ones():
    """1,024 peers with 64-character names do not fit a status reply's 64 kB: the worst-scored are kept."""
    peers = {
        f"{i:04d}" + "p" * 60: {"score": 1.0 - i / 2048, "failures": i, "latency_s": 0.001, "averaged": i}
        for i in range(1024)
    }
    report = {
        "name": "w0",
        "state": "training",
        "epoch": 1,
        "clock": 1.0,
        "loss": None,
        "exchanges_per_s": 1.0,
        "averaged": 1,
        "failures": 0,
        "bytes_in": 0,
        "bytes_out": 0,
        "served": 0,
        "pending": 0,
        "uptime_s": 1.0,
        "peers": peers,
        "barriers": {},
    }
    server = StatusServer(lambda: dict(report))
    request = Request(decode(encode(STATUS, 7, **{"from": "w1"})), (), b"", None)
    header = server.serve(request).header
    assert len(header) <= STATUS_REPORT.max_header_bytes
    kept = decode(header, {STATUS_REPORT.name: STATUS_REPORT})["peers"]
    assert 100 < len(kept) < 1024
    worst = sorted(peers, key=lambda p: peers[p]["score"])[: len(kept)]
    assert set(kept) == set(worst)


def test_every_node_is_asked_at_once(nodes):
    """Eight dead nodes cost one timeout, not eight; and every thread and socket is gone afterwards."""
    config = parse_config(make_config(8))
    started = time.monotonic()
    with StatusClient(config) as client:
        rows = client.ask(timeout_s=0.4)
    elapsed = time.monotonic() - started
    assert [row["state"] for row in rows] == ["unreachable"] * 8
    assert elapsed < 2.0, f"{elapsed:.2f} s: asked one after another (8 x 0.4 s = 3.2 s)?"
    assert not [t for t in threading.enumerate() if t.name.startswith("dpwa-tx-status")]


def test_a_node_at_a_barrier_says_so_and_its_epoch(tmp_path, nodes):
    cfg = make_config(2, fetch_probability=0)
    w0 = nodes(cfg, "w0", NumpyParams(filled(0)))
    w1 = nodes(cfg, "w1", NumpyParams(filled(1)))
    waiting = threading.Thread(target=w0.barrier, args=("epoch",), kwargs={"timeout_s": 30})
    waiting.start()
    try:
        assert wait_until(lambda: w0.state == "at_barrier", 10)
        path = write(tmp_path, cfg)
        rows = by_name(dpwa_status(path, "--json"))
        assert rows["w0"]["state"] == "at_barrier" and rows["w0"]["epoch"] == 1
        assert rows["w0"]["barriers"] == {"epoch": 1} and rows["w1"]["epoch"] == 0
        table = dpwa_status(path).stdout.splitlines()
        assert table[1].split()[:4] == ["w0", "at", "barrier", "1"]
    finally:
        w1.barrier("epoch", timeout_s=30)
        waiting.join(30)
    assert not waiting.is_alive()


def test_watch_with_count_prints_a_table_per_round(tmp_path, nodes):
    cfg = make_config(2, fetch_probability=0)
    for k in (0, 1):
        nodes(cfg, f"w{k}", NumpyParams(filled(k)))
    path = write(tmp_path, cfg)

    done = dpwa_status(path, "--watch", 0.1, "--count", 2)  # not a terminal: one table after the other
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sum(line.startswith("node  state") for line in lines) == 2
    assert sum(line.startswith("2 of 2 nodes answered") for line in lines) == 2
    assert "\x1b" not in done.stdout

    as_json = dpwa_status(path, "--json", "--watch", 0.1, "--count", 2)
    documents = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [[row["name"] for row in d["nodes"]] for d in documents] == [["w0", "w1"], ["w0", "w1"]]


def test_curve_asks_with_a_key_that_is_here_and_says_which_ones_it_tried(tmp_path, nodes):
    cfg = secure_config(tmp_path, 2, fetch_probability=0)
    w0 = nodes(cfg, "w0", NumpyParams(filled(0)))
    nodes(cfg, "w1", NumpyParams(filled(1)))
    steps(w0, 2, batch_size=1, loss=0.25)
    path = write(tmp_path, cfg)

    done = dpwa_status(path, "--json")
    assert done.returncode == 0, done.stderr
    rows = by_name(done)
    assert [rows[n]["state"] for n in ("w0", "w1")] == ["training", "training"]
    assert rows["w0"]["clock"] == 2.0 and rows["w0"]["loss"] == 0.25 and rows["w1"]["peers"] == {"w0": IDLE_PEER}
    as_w1 = dpwa_status(path, "--key", "w1")
    assert as_w1.returncode == 0 and as_w1.stdout.splitlines()[-1].endswith("(asked as w1)")

    for node in cfg["nodes"]:  # no secret key file is usable any more
        os.chmod(node["secret_key_file"], 0o644)
    refused = dpwa_status(path)
    assert refused.returncode == 1 and refused.stdout == ""
    message = refused.stderr
    assert message.startswith(f"dpwa status: {path}: the nodes use CURVE") and "no node's secret key file" in message
    for node in cfg["nodes"]:
        assert f"\n  {node['name']}: {node['secret_key_file']}: the secret key file can be read by others" in message
    assert message.rstrip().endswith(
        "Copy one node's NAME.key_secret to the path this config gives for it (mode 0600), and run status again"
    )
    one = dpwa_status(path, "--key", "w1")
    assert one.returncode == 1 and f"{path}: --key w1: {cfg['nodes'][1]['secret_key_file']}: " in one.stderr
    unknown = dpwa_status(path, "--key", "w9")
    assert unknown.returncode == 1 and "no node named 'w9'" in unknown.stderr


def test_a_node_of_another_cluster_answers_no_status(tmp_path, nodes):
    """A config whose names the node does not know: the node refuses, and the row says why."""
    cfg = make_config(1)
    nodes(cfg, "w0", NumpyParams(filled(0)))
    other = {**cfg, "nodes": [dict(cfg["nodes"][0], name="x0")]}
    rows = by_name(dpwa_status(write(tmp_path, other), "--json"))
    assert rows["x0"]["state"] == "unreachable" and "bad_identity" in rows["x0"]["reason"]


@pytest.mark.io
def test_errors_name_the_file_and_what_is_wrong(tmp_path):
    bad = write(tmp_path, {**make_config(2), "timeout_ms": -5}, "bad.yaml")
    done = dpwa_status(bad)
    assert done.returncode == 1
    assert done.stderr.strip() == f"dpwa status: {bad}: timeout_ms must be a positive integer, got -5"
    missing = dpwa_status(tmp_path / "nope.yaml")
    assert missing.returncode == 1 and "nope.yaml: no such config file or run folder" in missing.stderr
    run_dir = tmp_path / "run"
    (run_dir / "pids").mkdir(parents=True)
    mixed = dpwa_status(run_dir, "--json")
    assert mixed.returncode == 1 and "is a run folder; --json: only for a CONFIG file" in mixed.stderr
    assert dpwa_status(bad, "--count", 2).returncode == 1


@pytest.mark.io
def test_a_torchrun_config_is_refused_at_once_saying_why_and_what_to_use_instead(tmp_path):
    """Its nodes and keys live in torchrun's store only: no key file to try, no node to ask."""
    path = write(tmp_path, {"nodes": "torchrun", "timeout_ms": 2500}, "torchrun.yaml")
    for args in ((), ("--json",), ("--watch", 0.5, "--count", 2), ("--key", "rank0")):
        done = dpwa_status(path, *args)
        assert done.returncode == 1 and done.stdout == "", (args, done)
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr  # one line
        message = done.stderr.strip()
        assert message.startswith(f"dpwa status: {path}: nodes: torchrun: status cannot ask this cluster"), message
        assert "only in torchrun's store for the job's life" in message
        assert "stats()" in message and "metrics/rank<RANK>.jsonl" in message and "secret key file" not in message


def test_watch_redraws_in_place_on_a_terminal_and_ctrl_c_ends_it_quietly(tmp_path, nodes):
    cfg = make_config(2, fetch_probability=0)
    for k in (0, 1):
        nodes(cfg, f"w{k}", NumpyParams(filled(k)))
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpwa", "status", str(write(tmp_path, cfg)), "--watch", "0.1"],
        stdout=child,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    os.close(child)
    stderr = proc.stderr
    assert stderr is not None
    output = b""
    try:
        while output.count(b"2 of 2 nodes answered") < 2:  # two rounds drawn, then Ctrl-C
            assert select.select([main], [], [], 30)[0], f"no second table within 30 s: {output!r}"
            output += os.read(main, 65536)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert stderr.read() == b""  # no traceback
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        stderr.close()
        os.close(main)
    assert output.count(b"\x1b[H\x1b[2J") >= 2  # each round clears the screen and draws from the top
    assert b"every 0.1 s, Ctrl-C stops" in output


# --------------------------------------------------------------------------- what a node says about itself


def test_a_loss_beyond_what_the_wire_carries_does_not_silence_the_node(nodes):
    """w1 reports a finite loss of 1e35 (the wire carries |loss| <= 1e30). Its number is clamped where it
    is reported, so its replies still encode: w0 averages with it every step, and its status says
    1e30. (Before: its replies no longer encoded, w0 averaged 0 of 10, status called it unreachable,
    and the rejections were blamed on the requester.)"""
    cfg = make_config(2, **ORIGINAL, insecure=True, same_host="off")
    w0 = nodes(cfg, "w0", NumpyParams(filled(0)))
    w1 = nodes({**cfg, "fetch_probability": 0}, "w1", NumpyParams(filled(1)))
    w1.update_send(loss=1e35)
    w1.update_wait(loss=1e35)
    w1.update_send(loss=1e35)  # the snapshot peers get carries the loss
    averaged = 0
    for _ in range(10):
        w0.update_send()
        averaged += w0.update_wait().averaged
    assert averaged == 10
    with StatusClient(parse_config(cfg)) as client:
        rows = {row["name"]: row for row in client.ask(5.0)}
    assert rows["w1"]["state"] == "training" and rows["w1"]["loss"] == 1e30
    assert w1.stats().get("replies_unencodable", 0) == 0 and w0.stats().get("fetches_rejected", 0) == 0


def test_a_status_reply_fits_its_budget_with_700_peers_of_long_names_and_says_how_many_it_left_out(nodes):
    """A node whose config lists 700 peers with 64-character names: their table alone would exceed the
    64 KiB a status reply may hold. The reply keeps the worst-scored peers that fit, and
    peers_omitted counts the rest; the table says so. (Before: status failed for this node.)"""
    import zmq

    from dpwa.cluster.status import format_table
    from dpwa.gossip.reporting import STATUS, STATUS_BYTES, STATUS_REPORT
    from dpwa.wire.schema import decode, encode

    cfg = make_config(1, fetch_probability=0)
    me = cfg["nodes"][0]
    cfg["nodes"] = [me] + [{"name": f"{k:03d}" + "p" * 61, "host": "127.0.0.1", "port": 1 + k} for k in range(700)]
    nodes(cfg, "w0", NumpyParams(filled(0)))  # the 700 are names in its config; nobody is asked
    parsed = parse_config(cfg)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(parsed.endpoint(parsed.node("w0")))
        sock.send(encode(STATUS, 1, **{"from": "w0"}))
        assert sock.poll(10_000)
        raw = sock.recv()
        sock.close()
    finally:
        ctx.destroy(linger=0)
    assert len(raw) <= STATUS_BYTES
    report = dict(decode(raw, {STATUS_REPORT.name: STATUS_REPORT}).fields)
    shown = len(report["peers"])
    assert 0 < shown < 700 and shown + report["peers_omitted"] == 700
    row = {"peers_omitted": 0, **report}
    assert any(f"and {report['peers_omitted']} more" in line for line in format_table([row], width=200))
