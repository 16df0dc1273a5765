"""python -m dpwa.compare --byzantine K --attack offset|flip: the attacks, the refusals, the honest-only evaluation.

Unit tests on a tiny module and on hand-made snapshots; one short end-to-end
run (3 gossip workers on the digits, one Byzantine, about 20 s on two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import CHECKOUT_PATH, ROOT
from dpwa_lab.compare.__main__ import config_from, main, parse_args
from dpwa_lab.compare.byzantine import OFFSET_STDS, attack_, byzantine_names, published_wrong
from dpwa_lab.compare.evaluation import states
from dpwa_lab.compare.report import table
from dpwa_lab.compare.runner import RunOptions, SystemRun, byzantine_workers, plan_processes
from dpwa_lab.compare.workload import WorkloadSpec

pytestmark = pytest.mark.timeout(120)


def tiny() -> nn.Linear:
    """A Linear(2, 2) with known weights [[1, 2], [3, 4]] and bias [-1, 1], and a buffer."""
    net = nn.Linear(2, 2)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        net.bias.copy_(torch.tensor([-1.0, 1.0]))
    net.register_buffer("stat", torch.tensor([5.0, 6.0]))
    return net


def test_offset_shifts_each_tensor_by_ten_of_its_standard_deviations():
    net = tiny()
    with published_wrong(net, "offset"):
        # weight: mean 2.5, population std sqrt(1.25); bias: mean 0, std 1
        shift = OFFSET_STDS * 1.25**0.5
        assert OFFSET_STDS == 10.0
        assert torch.allclose(net.weight, torch.tensor([[1.0, 2.0], [3.0, 4.0]]) + shift, rtol=0, atol=1e-6)
        assert torch.equal(net.bias, torch.tensor([9.0, 11.0]))
        assert torch.equal(net.get_buffer("stat"), torch.tensor([5.0, 6.0]))  # buffers are published as they are


def test_flip_negates_every_parameter():
    net = tiny()
    with published_wrong(net, "flip"):
        assert torch.equal(net.weight, torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]))
        assert torch.equal(net.bias, torch.tensor([1.0, -1.0]))
        assert torch.equal(net.get_buffer("stat"), torch.tensor([5.0, 6.0]))


@pytest.mark.parametrize("attack", ["offset", "flip"])
def test_the_parameters_are_restored_exactly_after_the_publication(attack):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    before = [p.detach().clone() for p in net.parameters()]
    ids = [id(p) for p in net.parameters()]
    with published_wrong(net, attack):
        assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))  # bit for bit
    assert [id(p) for p in net.parameters()] == ids  # the same tensors, changed in place
    with pytest.raises(RuntimeError, match="inside"), published_wrong(net, attack):
        raise RuntimeError("inside")  # an error in the block restores them too
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))
    # training still works afterwards: autograd was not involved
    loss = net(torch.ones(1, 7)).sum()
    loss.backward()
    assert all(p.grad is not None for p in net.parameters())


def test_an_unknown_attack_is_refused():
    with pytest.raises(ValueError, match="unknown attack 'swap'"):
        attack_(torch.zeros(2), "swap")
    with pytest.raises(ValueError, match="unknown attack"), published_wrong(tiny(), "swap"):
        pass
    with pytest.raises(ValueError, match="unknown attack"):
        RunOptions(byzantine=1, attack="swap")


@pytest.mark.io
def test_the_byzantine_workers_are_the_last_k_of_a_gossip_system():
    spec = WorkloadSpec(data="digits", data_dir="", workers=5, epochs=1, batch_size=32, lr=0.05)
    options = RunOptions(byzantine=2, attack="flip")
    assert byzantine_names(5, 2) == ["w3", "w4"]
    assert byzantine_workers("gossip", spec, options) == ["w3", "w4"]
    assert byzantine_workers("allreduce", spec, options) == []
    assert byzantine_workers("gossip", spec, RunOptions()) == []
    system_options, starts, _ = plan_processes("gossip-original", spec, options, "t", Path("/nonexistent"))
    assert system_options["options"] == {"byzantine": ["w3", "w4"], "attack": "flip"}
    assert [s[0] for s in starts] == ["w0", "w1", "w2", "w3", "w4"]
    with pytest.raises(ValueError, match="fewer than half"):
        byzantine_workers("gossip", spec, RunOptions(byzantine=3))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--byzantine", "1", "--systems", "gossip,allreduce"], "--byzantine is for the gossip systems only"),
        (["--byzantine", "1"], "not sync-master, async-ps, allreduce, diloco"),  # the default: every system
        (["--byzantine", "2", "--systems", "gossip", "--workers", "4"], "must be fewer than half"),
        (["--byzantine", "1", "--systems", "gossip", "--workers", "2"], "must be fewer than half"),
        (["--byzantine", "-1", "--systems", "gossip"], "must be at least 0"),
        (["--byzantine", "1", "--systems", "gossip", "--attack", "swap"], "invalid choice: 'swap'"),
        (["--byzantine", "1", "--systems", "gossip", "--faults"], "--faults with --byzantine"),
    ],
)
def test_bad_byzantine_arguments_are_refused_by_argparse(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_arguments_reach_the_run_options():
    args = parse_args(["--byzantine", "1", "--attack", "flip", "--systems", "gossip,gossip-lowbw", "--workers", "3"])
    options = config_from(args).options
    assert (options.byzantine, options.attack) == (1, "flip")
    assert RunOptions().byzantine == 0 and RunOptions().attack == "offset"
    assert parse_args([]).byzantine == 0 and parse_args([]).attack == "offset"


def _snapshots(workdir: Path, name: str, rows: list[tuple[float, int, float, bool]]) -> list[dict]:
    (workdir / "snapshots").mkdir(parents=True, exist_ok=True)
    lines = []
    for k, (t, samples, value, final) in enumerate(rows):
        np.save(workdir / "snapshots" / f"{name}-{k}.npy", np.full(3, value, np.float32))
        lines.append(
            {"k": k, "t": t, "samples": samples, "file": f"{name}-{k}.npy", **({"final": True} if final else {})}
        )
    return lines


def test_the_curve_averages_the_honest_nodes_only(tmp_path):
    """Three nodes, w2 Byzantine (its snapshots hold 1000): every point is the mean of w0's and w1's, and the
    points fall where all three nodes' samples sum to 100, 200, ... (every node trains)."""
    snapshots = {
        "w0": _snapshots(tmp_path, "w0", [(0.0, 0, 0.0, False), (2.0, 100, 1.0, False), (3.0, 150, 3.0, True)]),
        "w1": _snapshots(tmp_path, "w1", [(0.0, 0, 0.0, False), (2.5, 100, 5.0, False), (3.5, 150, 7.0, True)]),
        "w2": _snapshots(tmp_path, "w2", [(0.0, 0, 1000.0, False), (2.2, 100, 1000.0, False), (3.2, 150, 1e3, True)]),
    }
    results = {
        "w0": {"progress": [[1.0, 50], [2.0, 100], [3.0, 150]]},
        "w1": {"progress": [[1.5, 50], [2.5, 100], [3.5, 150]]},
        "w2": {"progress": [[1.2, 50], [2.2, 100], [3.2, 150]]},
    }
    run = SystemRun("gossip", tmp_path, 0.0, True, None, results, snapshots, {}, ["w0", "w1", "w2"], byzantine=["w2"])
    points = [(t, n, float(load()[0])) for t, n, load in states(run, every=100)]
    # samples: w0 50 @1.0, w2 50 @1.2 -> 100; w1 50 @1.5 -> 150; w0 100 @2.0 -> 200; w2 @2.2 -> 250;
    # w1 @2.5 -> 300; w0 @3.0 -> 350; w2 @3.2 -> 400; w1 @3.5 -> 450
    assert points == [
        (1.2, 100, 0.0),
        (2.0, 200, 0.5),
        (2.5, 300, 3.0),
        (3.2, 400, 4.0),
        (3.5, 450, 5.0),  # the final model: w0's and w1's final snapshots, w2's left out
    ]
    # the same run without Byzantine workers averages all three
    run.byzantine = []
    assert [float(load()[0]) for _, _, load in states(run, every=100)][-1] == pytest.approx((3 + 7 + 1000) / 3)


def test_the_table_says_how_many_were_byzantine_and_which_attack():
    system = {
        "completed": True,
        "time_to_target_s": None,
        "samples_to_target": None,
        "final_test_acc": 0.5,
        "bytes_per_worker_per_step": 1.0,
        "idle_fraction": 0.1,
    }
    report = {"target_acc": 0.97, "workload": {"workers": 4}, "systems": {"gossip": system}}
    assert "byzantine" not in table({**report, "byzantine": 0, "attack": None})
    text = table({**report, "byzantine": 1, "attack": "flip"})
    assert "byzantine: 1 of 4 workers of every gossip system (w3), attack flip: each parameter tensor p" in text


@pytest.mark.slow
def test_a_short_run_with_a_byzantine_worker(tmp_path):
    json_path = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "dpwa.compare",
        "--quick",
        "--workload",
        "digits",
        "--epochs",
        "1",  # the attack's wiring and its report, not what it costs the model
        "--systems",
        "gossip",
        "--workers",
        "3",
        "--byzantine",
        "1",
        "--json",
        str(json_path),
        "--out",
        str(tmp_path / "run"),
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(json_path.read_text())
    assert report["byzantine"] == 1 and report["attack"] == "offset"
    assert report["options"]["byzantine"] == 1 and "p + 10 * std(p)" in report["byzantine_attack"]
    gossip = report["systems"]["gossip"]
    assert gossip["completed"] and gossip["workers_finished"] == 3
    assert gossip["byzantine_workers"] == ["w2"]
    assert gossip["wrong_snapshots_published"]["w2"] > 0  # the attack was wired to the node's publications
    assert "honest nodes" in gossip["evaluated_model"] and "(w2) left out" in gossip["evaluated_model"]
    assert "byzantine: 1 of 3 workers" in proc.stdout
    run = json.loads((tmp_path / "run" / "work" / "gossip" / "run.json").read_text())
    assert run["options"] == {"byzantine": ["w2"], "attack": "offset"}
    w2 = json.loads((tmp_path / "run" / "work" / "gossip" / "results" / "w2.json").read_text())
    w0 = json.loads((tmp_path / "run" / "work" / "gossip" / "results" / "w0.json").read_text())
    assert w2["byzantine"] == "offset" and w0["byzantine"] is None and w0["published_wrong"] == 0
