"""python -m dpwa.compare: one short comparison of every system on digits, its JSON and PNG, its rules, its errors.

The comparison runs once per session (a module fixture, about a minute on two
cores: six systems of two worker processes each) and the tests read what it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import CHECKOUT_PATH, ROOT
from dpwa.cluster.processes import process_start, read_pid_file
from dpwa_lab.compare.__main__ import main
from dpwa_lab.compare.evaluation import states
from dpwa_lab.compare.runner import SYSTEMS, SystemRun

# under parallel workers one worker runs all of this module's tests (tests/helpers/workers.py)
pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    json_path = out / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "dpwa.compare",
        "--workers",
        "2",
        "--epochs",
        "10",
        "--quick",
        "--keep-snapshots",
        "--json",
        str(json_path),
        "--out",
        str(out / "run"),
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    report = json.loads(json_path.read_text()) if json_path.exists() else None
    return proc, report, out / "run"


@pytest.mark.slow
def test_the_comparison_runs_and_prints_a_row_per_system(quick):
    proc, report, out = quick
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.split("system ", 1)[1]
    for system in SYSTEMS:
        assert f"\n{system} " in table
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "compare.json").read_text())["systems"].keys() == report["systems"].keys()


@pytest.mark.slow
def test_the_json_has_the_documented_shape(quick):
    _, report, _ = quick
    assert 0 < report["target_acc"] <= 1
    assert list(report["systems"]) == list(SYSTEMS)
    for name, system in report["systems"].items():
        assert system["completed"], (name, system["error"])
        assert 0 <= system["final_test_acc"] <= 1
        for key in ("time_to_target_s", "samples_to_target"):
            assert system[key] is None or system[key] >= 0
        assert system["bytes_per_worker_per_step"] > 0 and 0 <= system["idle_fraction"] <= 1
        assert system["evaluated_model"] and system["curve"][0][:2] == [0.0, 0]
        samples = [p[1] for p in system["curve"]]
        assert samples == sorted(samples)
    tasks = report["systems"]["sync-master"]["tasks"]
    assert set(tasks) >= {"total", "done", "retried", "done_twice"}
    assert tasks["done"] == tasks["total"] > 0 and tasks["done_twice"] == 0
    staleness = report["systems"]["async-ps"]["staleness"]
    assert staleness["mean"] >= 0 and sum(staleness["histogram"].values()) > 0
    diloco = report["systems"]["diloco"]
    steps = diloco["steps_per_worker"]
    assert diloco["period"] == 10 and diloco["syncs"] == -(-steps // 10)  # every 10 steps, and the last partial one
    assert diloco["outer"] == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert report["workload"]["data"] == "digits" and report["workload"]["workers"] == 2
    assert report["links"] is None and "link_check" not in report


def negative_running_variance(snapshots: Path) -> bool:
    """Whether a node's saved state holds a BatchNorm running variance below zero (none should)."""
    from dpwa_lab.compare.workload import WorkloadSpec, load_workload
    from dpwa_lab.systems.layout import ModuleView

    spec = WorkloadSpec(data="digits", data_dir="", workers=2, epochs=1, batch_size=32, lr=0.05)
    layout = ModuleView(load_workload(spec).build_model()).layout
    variances = [v for v in layout.buffers if v.name.endswith("running_var")]
    for path in snapshots.glob("*.npy"):
        state = np.load(path, allow_pickle=False)
        if any(state[layout.param_size + v.offset :][: v.size].min() < 0 for v in variances):
            return True
    return False


@pytest.mark.slow
def test_every_system_trains_digits_within_a_few_points_of_allreduce(quick):
    _, report, out = quick
    reference = report["systems"]["allreduce"]["final_test_acc"]
    assert reference > 0.9
    for name, system in report["systems"].items():
        assert abs(system["final_test_acc"] - reference) <= 0.04, (name, system["final_test_acc"], reference)
        assert system["nonfinite_points"] == 0, name  # every evaluated model gave a finite test loss
    # rule delta mixes running statistics convexly: no node's BatchNorm running variance went below zero
    assert not negative_running_variance(out / "work" / "gossip" / "snapshots")


@pytest.mark.slow
def test_no_process_is_left_behind(quick):
    _, _, out = quick
    pid_files = list((out / "work").glob("*/pids/*.pid"))
    assert len(pid_files) >= 2 + 2 + 3 + 4 + 2 + 2  # every process (every rank) of the six systems wrote one
    for pid_file in pid_files:
        pid, start = read_pid_file(pid_file)
        assert process_start(pid) != start, f"{pid_file} still runs"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--systems", "gossip,nope"], "unknown system nope"),
        (["--straggler", "0.5"], "--straggler must be in [1, 100]"),
        (["--workers", "0"], "must be at least 1"),
        (["--target-acc", "1.5"], "--target-acc must be in (0, 1]"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_device_cuda_without_a_gpu_is_refused_before_anything_starts(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/test_cuda.py runs the comparison on it")
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cuda", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda: torch" in err and "sees no GPU here" in err and "use --device cpu" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.io
def test_the_gpu_check_says_there_is_no_gpu_and_runs_nothing(tmp_path):
    """scripts/gpu-check.sh on a machine without a GPU: exit status 2, the reason, and only gpu.txt written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run scripts/gpu-check.sh itself")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), str(out)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch.cuda.is_available() is False" in proc.stdout and "no usable GPU here" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["gpu.txt"]


def test_an_output_folder_in_use_is_refused(tmp_path, capsys):
    (tmp_path / "something").write_text("x")
    assert main(["--out", str(tmp_path), "--systems", "gossip"]) == 2
    assert "is not empty" in capsys.readouterr().err


def _snapshots(workdir: Path, name: str, rows: list[tuple[float, int, float, bool]]) -> list[dict]:
    (workdir / "snapshots").mkdir(parents=True, exist_ok=True)
    lines = []
    for k, (t, samples, value, final) in enumerate(rows):
        np.save(workdir / "snapshots" / f"{name}-{k}.npy", np.full(3, value, np.float32))
        lines.append(
            {"k": k, "t": t, "samples": samples, "file": f"{name}-{k}.npy", **({"final": True} if final else {})}
        )
    return lines


def test_gossip_points_average_each_nodes_latest_snapshot_when_the_cluster_reached_the_samples(tmp_path):
    """Two nodes; the cluster passes 100, 200, 300 samples at t = 1.5, 2.5, 3.5; values known in advance."""
    snapshots = {
        "w0": _snapshots(tmp_path, "w0", [(0.0, 0, 0.0, False), (2.0, 100, 1.0, False), (3.0, 150, 3.0, True)]),
        "w1": _snapshots(tmp_path, "w1", [(0.0, 0, 0.0, False), (2.5, 100, 5.0, False), (3.5, 150, 7.0, True)]),
    }
    results = {
        "w0": {"progress": [[1.0, 50], [2.0, 100], [3.0, 150]]},
        "w1": {"progress": [[1.5, 50], [2.5, 100], [3.5, 150]]},
    }
    run = SystemRun("gossip", tmp_path, 0.0, True, None, results, snapshots, {}, ["w0", "w1"])
    points = [(t, n, float(load()[0])) for t, n, load in states(run, every=100)]
    assert points == [(1.5, 100, 0.0), (2.5, 200, 3.0), (3.5, 300, 5.0), (3.5, 300, 5.0)]
    # w1 killed after its snapshot at 2.5 (no results): it counts until then, not after
    del results["w1"]
    snapshots["w1"] = snapshots["w1"][:2]
    points = [(t, n, float(load()[0])) for t, n, load in states(run, every=100)]
    # without w1's per-step progress its snapshots say how far it got: the cluster reached 100 samples at
    # t = 2.0 (w0's 100), then 200 at 2.5 (w1's snapshot); the final model is w0's alone, w1 having died
    assert points == [(2.0, 100, 0.5), (2.5, 200, 3.0), (3.0, 250, 3.0)]


@pytest.mark.io
def test_noloco_is_an_opt_in_gossip_system_at_its_authors_settings():
    """--systems gossip-noloco: the defaults but an exchange every 10 steps and NoLoCo's outer step at lr 0.7,
    momentum 0.3 (the settings of its authors' configs); the default run leaves it out."""
    from dpwa.config import parse_config
    from dpwa_lab.compare.__main__ import parse_args
    from dpwa_lab.compare.runner import KNOWN_SYSTEMS, RunOptions, plan_processes
    from dpwa_lab.compare.workload import WorkloadSpec

    assert "gossip-noloco" in KNOWN_SYSTEMS and "gossip-noloco" not in SYSTEMS
    assert parse_args(["--systems", "gossip,gossip-noloco"]).systems == ("gossip", "gossip-noloco")
    spec = WorkloadSpec(data="digits", data_dir="", workers=4, epochs=1, batch_size=32, lr=0.05)
    options = plan_processes("gossip-noloco", spec, RunOptions(), "t", Path("/nonexistent"))[0]
    config = parse_config(options["gossip_config"], source="gossip-noloco")
    default = parse_config(plan_processes("gossip", spec, RunOptions(), "t", Path("/x"))[0]["gossip_config"])
    assert (config.period, config.outer, config.outer_lr, config.outer_momentum) == (10, "noloco", 0.7, 0.3)
    for key in ("mode", "rule", "pairing", "wire_dtype", "interpolation", "timeout_ms"):
        assert getattr(config, key) == getattr(default, key), key


def test_the_long_profile_is_a_named_set_of_flags_that_given_flags_override(tmp_path):
    from dpwa_lab.compare.__main__ import config_from, parse_args

    args = parse_args(["--profile", "long", "--out", str(tmp_path / "o")])
    assert (args.workload, args.steps, args.workers, args.time_limit_s) == ("charlm", 2000, 4, 3600.0)
    assert args.systems == ("gossip", "gossip-lowbw", "allreduce", "diloco")
    config = config_from(args)
    from dpwa_lab.compare.tune import SPACES

    assert config.spec.steps >= 100 * max(dict(SPACES["diloco"])["period"])  # 100 outer steps at any H tuned
    mine = parse_args(["--profile", "long", "--steps", "300", "--systems", "gossip"])
    assert (mine.steps, mine.systems, mine.workload) == (300, ("gossip",), "charlm")
