"""torchrun: `nodes: torchrun` configs meet through torchrun's store, with keys made at start;
one machine (--standalone), two simulated hosts (network namespaces), and a killed worker
under --max-restarts.

Every torchrun agent runs in its own process group (start_new_session) and is stopped by its
PID's group at the end, with its workers; the namespaces a test creates it deletes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CHECKOUT_PATH, ROOT, wait_until

pytestmark = pytest.mark.slow

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = dict(os.environ, PYTHONPATH=CHECKOUT_PATH, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
TRAIN = str(ROOT / "examples" / "pytorch-cifar" / "train.py")
SAMPLE = str(ROOT / "samples" / "torchrun.yaml")


class Agents:
    """torchrun agents started by a test; every one stopped (with its workers) by its process group."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, prefix: list[str] | None = None) -> subprocess.Popen:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                (prefix or []) + argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(20)


@pytest.fixture
def agents():
    made = Agents()
    yield made
    made.stop()


def metrics(run_dir: Path, node: str) -> list[dict]:
    path = run_dir / "metrics" / f"{node}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def standalone_workers(agents, tmp_path: Path, *worker_args: str) -> dict[str, dict]:
    """torchrun --standalone --nproc-per-node 3 of tests/helpers/torchrun_worker.py with `worker_args`;
    each rank's results by name."""
    out = tmp_path / "out"
    out.mkdir()
    worker = str(ROOT / "tests" / "helpers" / "torchrun_worker.py")
    argv = TORCHRUN + ["--standalone", "--nproc-per-node", "3", worker, str(out), *worker_args]
    proc = agents.start(argv, tmp_path / "torchrun.log")
    assert proc.wait(120) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    return {r["name"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}


@pytest.mark.timeout(150)
def test_standalone_workers_meet_through_the_store_and_every_rank_averages_with_every_other(agents, tmp_path):
    """torchrun --standalone --nproc-per-node 3, a tiny model, `nodes: torchrun`: the workers are
    rank0..rank2, with endpoints and CURVE keys swapped through the store; each averages with both
    others; at the fresh start ranks 1 and 2 took rank 0's initial parameters (their seeds differ)."""
    results = standalone_workers(agents, tmp_path, "40")
    assert sorted(results) == ["rank0", "rank1", "rank2"]
    for name, result in results.items():
        others = {"rank0", "rank1", "rank2"} - {name}
        assert set(result["peers"]) == others and all(n > 0 for n in result["peers"].values()), result
        assert result["secure"] and result["transport"] == "tcp"
        assert [n[0] for n in result["nodes"]] == ["rank0", "rank1", "rank2"]
    assert results["rank1"]["start"] == results["rank0"]["start"] == results["rank2"]["start"]
    assert results["rank0"]["joined"] is None and results["rank1"]["joined"] == "rank0"


@pytest.mark.timeout(150)
def test_a_plain_loop_without_barriers_starts_every_rank_together_like_ddp(agents, tmp_path):
    """torchrun --nproc-per-node 3 with a plain 60-step loop, no barrier of its own. Like DDP's, the
    constructor returns on every rank once every rank holds rank 0's initial state (a start barrier
    through torchrun's store), so rank 0 does not train alone: every rank averages from the start,
    rank 0 included, and all three start from the same parameters. (Before: rank 0 returned at once,
    trained its 60 steps with every fetch refused not_ready and closed, while ranks 1 and 2 were still
    joining from it; they timed out and started from their own.)"""
    results = standalone_workers(agents, tmp_path, "60", "plain")
    assert sorted(results) == ["rank0", "rank1", "rank2"]
    assert all(sum(r["peers"].values()) > 0 for r in results.values()), results
    assert results["rank1"]["start"] == results["rank0"]["start"] == results["rank2"]["start"]
    assert results["rank1"]["joined"] == results["rank2"]["joined"] == "rank0"


@pytest.mark.timeout(240)
def test_a_worker_killed_under_max_restarts_rejoins_and_the_run_finishes(agents, tmp_path):
    """Three workers train the digits example under torchrun --max-restarts 1. Once they train their
    third epoch, rank1 is killed with SIGKILL. torchrun stops the others (SIGTERM: each saves its
    state) and starts all three again: rank0 and rank2 restore what they saved, rank1, which saved
    nothing, joins from one of them; the run finishes (exit 0) in the usual accuracy band."""
    run_dir = tmp_path / "run"
    proc = agents.start(
        TORCHRUN
        + [
            "--standalone",
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            TRAIN,
            "--config",
            SAMPLE,
            "--run-dir",
            str(run_dir),
            "--epochs",
            "10",
        ],
        tmp_path / "torchrun.log",
    )
    assert wait_until(
        lambda: all(
            any(r["kind"] == "step" and r["epoch"] >= 3 for r in metrics(run_dir, f"rank{k}")) for k in range(3)
        ),
        150,
    ), (tmp_path / "torchrun.log").read_text()[-3000:]
    victim = [r for r in metrics(run_dir, "rank1") if r["kind"] == "start"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(180) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    starts = {k: [r for r in metrics(run_dir, f"rank{k}") if r["kind"] == "start"] for k in range(3)}
    assert all(len(s) == 2 for s in starts.values()), starts
    assert starts[1][1]["started"].startswith("joined the cluster at epoch") and starts[1][1]["clock"] > 0
    assert starts[1][1]["joined"]["donor"] in ("rank0", "rank2")
    for k in (0, 2):
        assert starts[k][1]["started"] == "restarted from the state saved when it was stopped"
    for k in range(3):
        records = metrics(run_dir, f"rank{k}")
        assert records[-1]["kind"] == "end" and records[-1]["reason"] == "done"
        evals = [r for r in records if r["kind"] == "eval"]
        assert evals[-1]["epoch"] == 10 and evals[-1]["test_acc"] >= 0.9, evals[-1]


def _namespaces_usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip"):
        return "needs ip(8) from iproute2"
    probe = f"dpwa-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add is not allowed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, on a private /24 chosen at random; deleted after."""
    why = _namespaces_usable()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 10000}-{random.randrange(1000)}"
    names = [f"dpwa-a-{tag}", f"dpwa-b-{tag}"]
    net = ipaddress.ip_network(f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}.0/24")
    addresses = [str(net.network_address + 1), str(net.network_address + 2)]
    veths = [f"dva{tag}"[:15], f"dvb{tag}"[:15]]
    commands = [
        ["ip", "netns", "add", names[0]],
        ["ip", "netns", "add", names[1]],
        ["ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1]],
    ]
    for ns, veth, address in zip(names, veths, addresses, strict=True):
        commands += [
            ["ip", "link", "set", veth, "netns", ns],
            ["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", veth],
            ["ip", "-n", ns, "link", "set", veth, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        yield names, addresses
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


@pytest.mark.timeout(240)
def test_two_hosts_train_the_digits_example_across_network_namespaces(agents, tmp_path, two_hosts):
    """Two hosts, simulated: a torchrun agent in each of two network namespaces joined by a veth pair,
    two workers each, rendezvous over the veth (c10d, the store in the first namespace). They train
    the digits example to the usual accuracy, and every worker averages with a worker of the other
    host (TCP with CURVE across the veth; shared memory inside one namespace)."""
    (ns_a, ns_b), (addr_a, addr_b) = two_hosts
    run_dir = tmp_path / "run"
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{addr_a}:29400",
        "--rdzv-id",
        "dpwa-test",
    ]
    train = [TRAIN, "--config", SAMPLE, "--run-dir", str(run_dir), "--epochs", "8"]
    host = {addr_a: "a", addr_b: "b"}
    procs = []
    for ns, address, is_host in ((ns_a, addr_a, 1), (ns_b, addr_b, 0)):
        # --local-addr and is_host: inside a namespace the machine's host name resolves elsewhere
        argv = TORCHRUN + common + ["--rdzv-conf", f"is_host={is_host}", "--local-addr", address] + train
        procs.append(agents.start(argv, tmp_path / f"{ns}.log", prefix=["ip", "netns", "exec", ns]))
    for proc, ns in zip(procs, (ns_a, ns_b), strict=True):
        assert proc.wait(200) == 0, (tmp_path / f"{ns}.log").read_text()[-3000:]
    ends = {}
    for k in range(4):
        records = metrics(run_dir, f"rank{k}")
        end, evals = records[-1], [r for r in records if r["kind"] == "eval"]
        assert end["kind"] == "end" and end["reason"] == "done", end
        assert evals[-1]["test_acc"] >= 0.9, evals[-1]
        ends[f"rank{k}"] = end
    hosts: dict[str, str | None] = {}  # rank -> the namespace its endpoint is in, from a node's start line
    text = "\n".join((tmp_path / f"{ns}.log").read_text() for ns in (ns_a, ns_b))
    line = next(line for line in text.splitlines() if " starting on tcp://" in line and "nodes=[" in line)
    for item in line.split("nodes=[", 1)[1].split("]", 1)[0].split(", "):
        name, endpoint = item.split("@")
        hosts[name] = host.get(endpoint.rsplit(":", 1)[0])
    assert sorted(hosts) == [f"rank{k}" for k in range(4)], hosts
    assert sorted(hosts.values(), key=str) == ["a", "a", "b", "b"], hosts  # key=str: a None (neither) sorts too
    for name, end in ends.items():
        # the node's own per-peer count: exchanges it started and (mode symmetric) those a peer started with it.
        # At 4 nodes pairing is a hypercube: each rank meets 2 of the 3 others, at least one across the veth.
        averaged = {p: row["averaged"] for p, row in end["stats"]["peers"].items()}
        other_host = [p for p in averaged if hosts[p] != hosts[name]]
        assert len(other_host) == 2 and any(averaged[p] > 0 for p in other_host), (name, averaged, hosts)
