"""python -m dpwa.compare --churn: workers leave while each run trains, and what each system does about it.

Gossip (open membership) replaces each leaver at once by a newcomer that joins through bootstrap addresses
and takes a member's state; all-reduce restarts every rank from rank 0's last checkpoint, as torchrun
--max-restarts does. Checked: the schedule and its refusals on their own, and a real run of both on the
digits, each reaching the target after the churn.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from dpwa_lab.compare.__main__ import main
from dpwa_lab.compare.churn import Churn, trained_samples
from dpwa_lab.compare.runner import RunOptions, open_config


def write_snapshots(folder: Path, name: str, samples: list[int]) -> None:
    (folder / "snapshots").mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"k": k, "t": float(k), "samples": s, "file": f"{name}-{k}.npy"}) for k, s in enumerate(samples)
    ]
    (folder / "snapshots" / f"{name}.jsonl").write_text("\n".join(lines) + '\n{"k": 9, "t"')  # a torn last line


def test_events_come_at_fractions_of_the_samples_and_are_read_from_the_snapshots(tmp_path) -> None:
    churn = Churn("gossip", 3, 4, 4000)
    assert churn.thresholds == [1000, 2000, 3000]
    write_snapshots(tmp_path, "w0", [0, 100, 250])
    write_snapshots(tmp_path, "w1", [0, 300])
    assert trained_samples(tmp_path, "gossip", ["w0", "w1", "w2"]) == 550  # w2 has written nothing yet
    write_snapshots(tmp_path, "rank0", [0, 600, 1200])
    write_snapshots(tmp_path, "rank1", [0, 5])  # every rank holds the same: rank 0 speaks for the cluster
    assert trained_samples(tmp_path, "allreduce", ["rank0", "rank1"]) == 1200


@pytest.mark.parametrize(
    ("system", "events", "workers", "message"),
    [
        ("diloco", 1, 4, "--churn runs gossip"),
        ("sync-master", 1, 4, "--churn runs gossip"),
        ("gossip", 0, 4, "at least 1 event"),
        ("allreduce", 1, 1, "at least 2 workers"),
    ],
)
def test_churn_refuses_what_it_does_not_run(system, events, workers, message) -> None:
    with pytest.raises(ValueError, match=message):
        Churn(system, events, workers, 1000)


def test_a_churn_config_lists_only_its_node_and_joins_through_the_first_workers() -> None:
    nodes = [{"name": f"w{i}", "host": "127.0.0.1", "port": 45000 + i} for i in range(5)]
    config: dict[str, Any] = {"nodes": nodes, "timeout_ms": 1000, "join": "never"}
    mine = open_config(config, "w4")
    assert mine["nodes"] == [nodes[4]] and mine["join"] == "never"
    assert mine["bootstrap"] == ["127.0.0.1:45000", "127.0.0.1:45001", "127.0.0.1:45002"]
    newcomer = open_config(config, "w5", {"name": "w5", "host": "127.0.0.1", "port": 46000})
    assert newcomer["nodes"] == [{"name": "w5", "host": "127.0.0.1", "port": 46000}] and newcomer["join"] == "auto"
    from dpwa.config import parse_config

    assert parse_config(newcomer).pairing == "random"  # open membership has no fixed indices


@pytest.mark.parametrize(
    "argv",
    [
        ["--churn", "1", "--systems", "gossip,diloco"],
        ["--churn", "1", "--faults"],
        ["--churn", "1", "--tune", "2"],
        ["--churn", "1", "--link-mbit", "20"],
        ["--churn", "0"],
    ],
)
def test_the_command_refuses_churn_with_what_it_cannot_run_with(argv, capsys, tmp_path) -> None:
    code: object
    try:
        code = main(["--out", str(tmp_path / "out"), *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "--churn" in err, err


def test_run_options_refuse_churn_with_links_or_byzantine_workers() -> None:
    with pytest.raises(ValueError, match="churn runs over loopback"):
        RunOptions(churn=1, byzantine=1)
    with pytest.raises(ValueError, match="at least 0"):
        RunOptions(churn=-1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_churn_run_replaces_a_gossip_node_and_restarts_all_reduce_and_both_reach_the_target(tmp_path) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "--workload", "digits", "--workers", "3", "--quick", "--systems", "gossip,allreduce",
            "--churn", "1", "--target-acc", "0.95", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((out / "compare.json").read_text())
    gossip, allreduce = report["systems"]["gossip"], report["systems"]["allreduce"]
    assert [e["killed"] for e in gossip["churn"]] == ["w2"]
    assert gossip["churn"][0]["joined"] == "w3" and gossip["churn"][0]["shard"] == 2
    assert gossip["churn"][0]["skip_samples"] > 0  # it went on from where w2 was
    assert allreduce["churn"][0]["killed"] == "rank2" and allreduce["churn"][0]["round"] == 1
    for summary in (gossip, allreduce):
        assert summary["completed"], summary["error"]
        assert summary["time_to_target_s"] is not None, summary["curve"]
        assert summary["final_test_acc"] >= 0.95
    results = {p.stem: json.loads(p.read_text()) for p in (out / "work" / "gossip" / "results").glob("*.json")}
    assert results["w3"]["joined"] in ("w0", "w1") and results["w3"]["skipped_samples"] > 0
    assert "w2" not in results  # killed: it wrote nothing
    ranks = {p.stem: json.loads(p.read_text()) for p in (out / "work" / "allreduce" / "results").glob("*.json")}
    assert sorted(ranks) == ["rank0", "rank1", "rank2"] and all(r["round"] == 1 for r in ranks.values())
    assert report["churn"]["leaving"] == 1 and set(report["churn"]["events"]) == {"gossip", "allreduce"}


class FakeProcs:
    """What Churn asks of a run's processes, recorded instead of done."""

    def __init__(self, names: list[str]) -> None:
        self.procs = dict.fromkeys(names)
        self.killed: dict[str, float] = {}
        self.started: list[tuple[str, str, int]] = []

    def running(self, name: str) -> bool:
        return name not in self.killed

    def kill(self, name: str) -> bool:
        self.killed[name] = 0.0
        return True

    def start(self, name: str, role: str, run_file: Path, index: int = 0, **_: Any) -> None:
        self.procs[name] = None
        self.started.append((name, role, index))


@pytest.mark.io
def test_a_newcomer_replaced_in_turn_hands_on_where_the_shard_was(tmp_path) -> None:
    """Three workers, two events: w2 leaves at its 900th sample and w3 takes shard 2 from there; then w3 (the
    only one that may leave: w0 and w1 are the bootstrap nodes) leaves at its own 500th, and w4 goes on from
    sample 1,400 of shard 2."""
    from dpwa_lab.compare.runner import LiveRun

    nodes: list[dict[str, Any]] = [{"name": f"w{i}", "host": "127.0.0.1", "port": 45000 + i} for i in range(3)]
    config: dict[str, Any] = {"nodes": nodes, "timeout_ms": 1000, "join": "never"}
    run: dict[str, Any] = {
        "run_file": str(tmp_path / "run.json"),
        "gossip_config": config,
        "gossip_configs": {n["name"]: open_config(config, n["name"]) for n in nodes},
        "joiners": {},
    }
    procs = FakeProcs(["w0", "w1", "w2"])
    live = LiveRun("gossip", tmp_path, run, procs, time.time(), ["w0", "w1", "w2"])  # type: ignore[arg-type]
    churn = Churn("gossip", 2, 3, 6000)
    for name, samples in (("w0", [2000]), ("w1", [2000]), ("w2", [0, 900])):
        write_snapshots(tmp_path, name, samples)
    churn.poll(live)
    assert procs.started == [("w3", "gossip", 2)] and run["joiners"]["w3"]["skip_samples"] == 900
    assert run["gossip_configs"]["w3"]["join"] == "auto"
    assert json.loads((tmp_path / "run.json").read_text())["joiners"]["w3"]["skip_samples"] == 900
    write_snapshots(tmp_path, "w3", [0, 500])
    churn._read_at = 0.0  # noqa: SLF001 - its pacing is not what is tested
    churn.poll(live)
    assert procs.started[-1] == ("w4", "gossip", 2) and run["joiners"]["w4"]["skip_samples"] == 1400
    assert [e["killed"] for e in churn.done] == ["w2", "w3"] and live.workers[-2:] == ["w3", "w4"]
