"""The mean of a cluster's weights: dpwa.cluster.average and ``python -m dpwa average``.

Run folders are written here with the library's checkpoint writer, each node's state made by train.py's own
``node_state``; live clusters are adapters in this process. Nodes hold known values (0, 2, 4: mean 2 exactly).
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from conftest import make_config  # noqa: E402
from dpwa.cli import main as cli  # noqa: E402
from dpwa.cluster.average import (  # noqa: E402
    AverageError,
    average,
    average_live,
    average_run,
    average_state_dicts,
    mean_state_dict,
)
from dpwa.cluster.launch import LaunchSpec  # noqa: E402
from dpwa.runfiles import checkpoints  # noqa: E402
from example_helpers import ROOT  # noqa: E402 - puts the example on sys.path

# train.py's own node_state writes the checkpoints here: imported by name, so that mypy (which checks what
# the tests import) leaves the script to its own checks
train = importlib.import_module("train")


def make_net(value: float = 0.0, count: int = 0) -> nn.Sequential:
    """A tiny model with a BatchNorm (floating running statistics, an integer batch counter)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():
        for name, tensor in net.state_dict(keep_vars=True).items():
            tensor.fill_(value if tensor.is_floating_point() else count)
            if name == "1.running_var":
                tensor.fill_(value + 1)  # a variance of 0 is allowed, but let one tensor differ from the rest
    return net


class _Conn:
    """What train.py's node_state reads of the adapter."""

    clock = 12.0

    def barrier_counters(self) -> dict[str, int]:
        return {"epoch": 1}

    def outer_state(self) -> None:
        return None

    def rule_state(self) -> None:
        return None

    def checkpoint(self) -> dict:
        """As DpwaPyTorchAdapter.checkpoint gathers the four."""
        return {"clock": self.clock, "barriers": self.barrier_counters(), "outer": None, "rule": None}


def save_node(run_dir: Path, epoch: int | str, node: str, net: nn.Module) -> Path:
    """`node`'s checkpoint of `epoch` as train.py writes it: node_state(...), saved by checkpoints.save."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    order = torch.Generator().manual_seed(1)
    progress = {"epoch": 1, "step": 10, "averaged": 3, "failed": 0}
    state = train.node_state(net, optimizer, schedule, order, _Conn(), progress)
    return checkpoints.save(run_dir, epoch, node, state)


def write_run(run_dir: Path, values: dict[str, float], epoch: int | str = 1) -> Path:
    """A run folder whose nodes w0, w1, ... saved `epoch` holding `values` (and batch counters 10, 20, ...)."""
    for i, (node, value) in enumerate(values.items()):
        save_node(run_dir, epoch, node, make_net(value, count=10 * (i + 1)))
    return run_dir


def check_mean(state: dict[str, Any], value: float, count: int) -> None:
    for name, tensor in state.items():
        if name == "1.running_var":
            assert torch.equal(tensor, torch.full_like(tensor, value + 1)), name
        elif tensor.is_floating_point():
            assert torch.equal(tensor, torch.full_like(tensor, value)), name
        else:
            assert torch.equal(tensor, torch.full_like(tensor, count)), name


# --------------------------------------------------------------------------- the mean of state_dicts


def test_the_mean_is_exact_and_integer_tensors_are_the_first_states():
    states = {f"n{v}": make_net(v, count=v + 1).state_dict() for v in (0, 2, 4)}
    mean = average_state_dicts(states)
    check_mean(mean, 2.0, 1)  # the first state's batch counter, not the max (5) nor a mean (3)
    assert list(mean) == list(states["n0"])  # the first state's order
    assert mean["0.weight"].dtype == torch.float32
    weighted = average_state_dicts(states, weights={"n0": 1.0, "n2": 1.0, "n4": 2.0})
    assert torch.equal(weighted["0.weight"], torch.full((4, 3), 2.5))  # (0 + 2 + 2*4) / 4
    with pytest.raises(AverageError, match="n4: no weight given"):
        average_state_dicts(states, weights={"n0": 1.0, "n2": 1.0})
    with pytest.raises(AverageError, match="n2: its weight must be a finite number > 0"):
        average_state_dicts(states, weights={"n0": 1.0, "n2": 0.0, "n4": 1.0})


def test_states_that_differ_or_hold_nan_are_refused_naming_them():
    a, b = make_net(1.0).state_dict(), make_net(3.0).state_dict()
    with pytest.raises(AverageError, match=r"b\.pt: its tensor names differ from a\.pt's; it lacks 2\.bias"):
        average_state_dicts({"a.pt": a, "b.pt": {k: v for k, v in b.items() if k != "2.bias"}})
    with pytest.raises(AverageError, match=r"b\.pt: 2\.bias is \[3\] float32, in a\.pt \[2\] float32"):
        average_state_dicts({"a.pt": a, "b.pt": {**b, "2.bias": torch.zeros(3)}})
    with pytest.raises(AverageError, match=r"b\.pt: 2\.bias is \[2\] float64"):
        average_state_dicts({"a.pt": a, "b.pt": {**b, "2.bias": torch.zeros(2, dtype=torch.float64)}})
    for bad in (math.nan, math.inf):
        spoiled = {**b, "0.bias": torch.tensor([0.0, bad, 0.0, 0.0])}
        with pytest.raises(AverageError, match=r"b\.pt: 0\.bias holds NaN or Inf"):
            average_state_dicts({"a.pt": a, "b.pt": spoiled})
    with pytest.raises(AverageError, match="a.pt: not a state_dict"):
        average_state_dicts({"a.pt": {"x": [1.0]}})  # type: ignore[dict-item]
    with pytest.raises(AverageError, match="no states to average"):
        average_state_dicts({})


# --------------------------------------------------------------------------- a run folder


def test_a_run_folders_latest_complete_checkpoint_is_averaged_and_loads_into_the_model(tmp_path):
    write_run(tmp_path, {"w0": 9.0, "w1": 9.0, "w2": 9.0}, epoch=0)
    write_run(tmp_path, {"w0": 0.0, "w1": 2.0, "w2": 4.0}, epoch=1)
    result = average_run(tmp_path)
    assert result.checkpoint == 1 and result.missing == () and result.notes == () and result.weights is None
    assert result.sources == {n: str(tmp_path / "checkpoints" / "epoch-1" / f"{n}.pt") for n in ("w0", "w1", "w2")}
    check_mean(result.state_dict, 2.0, 10)  # w0's batch counter
    torch.save(result.state_dict, tmp_path / "mean.pt")
    loaded = torch.load(tmp_path / "mean.pt", weights_only=True)
    net = make_net()
    net.load_state_dict(loaded)  # strict: every name, every shape
    check_mean(net.state_dict(), 2.0, 10)
    assert torch.equal(mean_state_dict(tmp_path, epoch=0)["0.weight"], torch.full((4, 3), 9.0))
    weighted = average_run(tmp_path, weights={"w0": 2.0, "w1": 1.0, "w2": 1.0})
    assert torch.equal(weighted.state_dict["0.weight"], torch.full((4, 3), 1.5))
    assert weighted.weights == {"w0": 2.0, "w1": 1.0, "w2": 1.0}
    # the states saved when every node was stopped come after the epochs' (as train.py --resume takes them)
    write_run(tmp_path, {"w0": 6.0, "w1": 6.0, "w2": 9.0}, epoch=checkpoints.LAST)
    assert average(tmp_path).checkpoint == checkpoints.LAST
    assert torch.equal(mean_state_dict(tmp_path)["2.bias"], torch.full((2,), 7.0))


def test_a_node_without_a_state_is_refused_or_left_out_when_allowed(tmp_path):
    spec = LaunchSpec(run_dir=str(tmp_path), config=make_config(4), command=["true"])
    spec.save()  # the run started w0..w3 here
    write_run(tmp_path, {"w0": 1.0, "w1": 3.0, "w2": 5.0}, epoch=0)
    write_run(tmp_path, {"w0": 0.0, "w1": 2.0}, epoch=1)
    with pytest.raises(AverageError, match=r"no checkpoint holds every node's state \(.*w3: none\)") as caught:
        average_run(tmp_path)
    assert "w2: epoch 0;" in str(caught.value) and "--allow-missing" in str(caught.value)
    with pytest.raises(AverageError, match=r"epoch-0/manifest\.json: no state of w3 in epoch 0"):
        average_run(tmp_path, epoch=0)
    with pytest.raises(AverageError, match=r"epoch-7: no checkpoint here \(have: epoch 1, epoch 0\)"):
        average_run(tmp_path, epoch=7)
    result = average_run(tmp_path, allow_missing=True)  # the checkpoint most nodes saved: epoch 0
    assert result.checkpoint == 0 and result.missing == ("w3",) and list(result.sources) == ["w0", "w1", "w2"]
    assert torch.equal(result.state_dict["0.weight"], torch.full((4, 3), 3.0))
    assert any("missing: w3" in note for note in result.notes)
    chosen = average_run(tmp_path, epoch=1, allow_missing=True)
    assert chosen.missing == ("w2", "w3") and torch.equal(chosen.state_dict["0.weight"], torch.full((4, 3), 1.0))
    # without launch.json the nodes are those the checkpoints list: epoch 0 is complete, epoch 1 newer
    (tmp_path / "launch.json").unlink()
    result = average_run(tmp_path)
    assert result.checkpoint == 0 and result.notes == ("newer checkpoints lack some nodes: epoch 1 (w2)",)


def test_a_damaged_or_spoiled_checkpoint_is_refused_naming_its_file(tmp_path):
    write_run(tmp_path, {"w0": 0.0, "w1": 2.0})
    path = tmp_path / "checkpoints" / "epoch-1" / "w1.pt"
    spoiled = make_net(2.0)
    with torch.no_grad():
        spoiled.state_dict()["2.bias"][1] = math.nan
    save_node(tmp_path, 1, "w1", spoiled)
    with pytest.raises(AverageError, match=rf"^{path}: 2\.bias holds NaN or Inf$"):
        average_run(tmp_path)
    save_node(tmp_path, 1, "w1", nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    with pytest.raises(AverageError, match=rf"^{path}: its tensor names differ from .*w0\.pt's; it lacks 1\.running"):
        average_run(tmp_path)
    save_node(tmp_path, 1, "w1", make_net(2.0))
    path.write_bytes(path.read_bytes()[:-1] + b"x")
    with pytest.raises(AverageError, match=rf"^{path}: its SHA-256 does not match the manifest"):
        average_run(tmp_path)
    save_node(tmp_path, 1, "w1", make_net(2.0))
    save_node(tmp_path, 2, "w0", make_net(2.0))
    save_node(tmp_path, 2, "w1", make_net(2.0))
    manifest = tmp_path / "checkpoints" / "epoch-2" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"w1.pt"', '"../epoch-1/w1.pt"'))
    with pytest.raises(AverageError, match=rf"^{manifest}: files\['w1'\]: 'file' must be 'w1.pt'"):
        average_run(tmp_path, epoch=2)
    result = average_run(tmp_path)  # the damaged epoch is passed over, and said so
    assert result.checkpoint == 1 and result.notes[0].startswith(f"skipped: {manifest}: files['w1']")
    with pytest.raises(AverageError, match="no such run folder"):
        average_run(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AverageError, match="no checkpoints"):
        average_run(tmp_path / "empty")


def test_a_pushsum_run_says_its_mean_is_unweighted(tmp_path):
    config = make_config(2, mode="pull", rule="pushsum")
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    write_run(tmp_path, {"w0": 0.0, "w1": 2.0})
    result = average_run(tmp_path)
    assert any("rule pushsum: the checkpoints keep no pushsum weight" in note for note in result.notes)
    assert average_run(tmp_path, weights={"w0": 1.0, "w1": 1.0}).notes == ()


# --------------------------------------------------------------------------- the command


def test_the_command_writes_the_mean_and_says_which_files_it_used(tmp_path, capsys):
    run = write_run(tmp_path / "run", {"w0": 0.0, "w1": 2.0, "w2": 4.0})
    out = tmp_path / "mean.pt"
    assert cli(["average", str(run), "-o", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        *(f"{n}  {run / 'checkpoints' / 'epoch-1' / (n + '.pt')}" for n in ("w0", "w1", "w2")),
        f"wrote {out}: the mean of 3 nodes' checkpoints of epoch 1",
    ]
    assert out.stat().st_mode & 0o777 == 0o600
    net = make_net()
    net.load_state_dict(torch.load(out, weights_only=True))
    check_mean(net.state_dict(), 2.0, 10)
    assert cli(["average", str(run), "-o", str(out), "--epoch", "5"]) == 1
    assert "dpwa average: " in capsys.readouterr().err
    assert cli(["average", str(run), "-o", str(out), "--epoch", "x"]) == 1
    assert "--epoch takes an epoch number or 'last'" in capsys.readouterr().err
    assert cli(["average", str(run), "-o", str(out), "--key", "w0"]) == 1
    assert "--key: only with --config" in capsys.readouterr().err
    assert cli(["average", "-o", str(out)]) == 1
    assert "give a RUN_DIR, or --config FILE" in capsys.readouterr().err
    assert cli(["average", str(run), "-o", str(tmp_path / "no" / "mean.pt")]) == 1
    assert "no folder" in capsys.readouterr().err
    save_node(run, 2, "w0", make_net(1.0))  # a newer epoch that only w0 saved
    assert cli(["average", str(run), "-o", str(out), "--epoch", "2", "--allow-missing"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == f"wrote {out}: the mean of 1 nodes' checkpoints of epoch 2"
    assert "dpwa average: missing: w1, w2" in captured.err


@pytest.mark.timeout(120)
@pytest.mark.io
def test_python_m_dpwa_average_end_to_end(tmp_path):
    run = write_run(tmp_path / "run", {"w0": 0.0, "w1": 2.0, "w2": 4.0})
    out = tmp_path / "mean.pt"
    command = [sys.executable, "-m", "dpwa", "average", str(run), "-o", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"w0  {run / 'checkpoints' / 'epoch-1' / 'w0.pt'}"
    assert done.stdout.splitlines()[-1] == f"wrote {out}: the mean of 3 nodes' checkpoints of epoch 1"
    check_mean(torch.load(out, weights_only=True), 2.0, 10)
    spoiled = make_net(2.0)
    with torch.no_grad():
        spoiled.state_dict()["0.weight"][0, 0] = math.inf
    path = save_node(run, 1, "w1", spoiled)
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"dpwa average: {path}: 0.weight holds NaN or Inf\n"


# --------------------------------------------------------------------------- a live cluster


def test_a_live_clusters_snapshots_are_averaged_exactly(adapters, make_cluster, tmp_path, monkeypatch, capsys):
    config = {**make_cluster(3), "fetch_probability": 0}  # the nodes serve and never mix
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(config))
    for name, value in (("w0", 0.0), ("w1", 2.0), ("w2", 4.0)):
        adapter = adapters(make_net(value, count=7), name, config)
        adapter.update_send()  # publish the snapshot
        adapter.update_wait()
    result = average(path, model=make_net(9.0, count=5))
    assert result.checkpoint is None and list(result.sources) == ["w0", "w1", "w2"]
    check_mean(result.state_dict, 2.0, 5)  # the batch counter is the given model's: snapshots carry floats only
    net = make_net()
    net.load_state_dict(result.state_dict)
    assert not [t for t in threading.enumerate() if t.name.startswith("dpwa-tx-average")]  # its clients closed
    with pytest.raises(AverageError, match=r"^w0 \(.*\): no snapshot: .*fingerprint"):
        average_live(path, nn.Sequential(nn.Linear(3, 4)))  # not the nodes' model: refused by the nodes
    with pytest.raises(AverageError, match="give model="):
        average(path)
    # the command: --model names a function that builds the model
    module = f"average_nets_{make_cluster.transport}"
    (tmp_path / f"{module}.py").write_text(
        "from torch import nn\n\n\ndef make():\n"
        "    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "mean.pt"
    assert cli(["average", "--config", str(path), "--model", f"{module}:make", "-o", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["w0", "w1", "w2"]
    assert lines[-1] == f"wrote {out}: the mean of 3 nodes' current snapshots"
    mean = torch.load(out, weights_only=True)
    check_mean(mean, 2.0, 0)  # a fresh BatchNorm's batch counter
    assert cli(["average", "--config", str(path), "--model", f"{module}:nothing", "-o", str(out)]) == 1
    assert f"--model {module}:nothing: AttributeError" in capsys.readouterr().err


def test_a_live_node_that_does_not_answer_is_named(adapters, tmp_path):
    config = {**make_config(2, insecure=True, same_host="off"), "fetch_probability": 0}
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(config))
    adapter = adapters(make_net(1.0), "w0", config)
    adapter.update_send()
    adapter.update_wait()
    with pytest.raises(AverageError, match=r"^w1 \(tcp://127\.0\.0\.1:\d+\): no snapshot"):
        average_live(path, make_net(), timeout_s=0.5)


def test_a_live_pushsum_cluster_gives_its_plain_mean_and_keeps_its_weight(adapters, tmp_path):
    """A tool's fetch names no rule, so a push-sum node gives it none of its weight (before, every average
    halved every node's weight): the mean of 0 and 2 is 1, with a note, and both weights stay 1."""
    config = {**make_config(2, mode="pull", rule="pushsum", insecure=True, same_host="off"), "fetch_probability": 0}
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(config))
    made = []
    for name, value in (("w0", 0.0), ("w1", 2.0)):
        adapter = adapters(make_net(value), name, config)
        adapter.update_send()
        adapter.update_wait()
        made.append(adapter)
    for _ in range(2):
        result = average_live(path, make_net())
        check_mean(result.state_dict, 1.0, 0)
        assert any("rule pushsum: the nodes send a tool no weight" in note for note in result.notes)
    assert [a.node.stats()["rule.weight"] for a in made] == [1.0, 1.0]
