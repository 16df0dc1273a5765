"""The example's data, models and evaluation: CIFAR-10 files written here, the embedded digits, shards, augmentation."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# isort: off
from example_helpers import EXAMPLE, cifar_pixel, write_cifar_batch, write_cifar_dir  # noqa: E402 - puts the example on sys.path

import data as datasets  # noqa: E402
import evaluate  # noqa: E402
import models  # noqa: E402
# isort: on

from conftest import CHECKOUT_PATH, make_config, wait_until  # noqa: E402

# --------------------------------------------------------------------------- CIFAR-10 python batches


def test_cifar_loader_reads_every_pixel_and_label_in_place(tmp_path):
    folder = write_cifar_dir(tmp_path, per_batch=4, test=3)
    assert datasets.cifar_is_prepared(folder)
    data = datasets.load_cifar10(folder)
    assert data.train_x.shape == (20, 3, 32, 32) and data.train_x.dtype == torch.uint8
    assert data.test_x.shape == (3, 3, 32, 32)
    assert data.train_y.tolist() == [i % 10 for i in range(20)]
    assert data.test_y.tolist() == [0, 1, 2]
    for i, c, y, x in [(0, 0, 0, 0), (5, 1, 7, 30), (19, 2, 31, 31), (12, 2, 0, 17)]:
        assert data.train_x[i, c, y, x].item() == cifar_pixel(i, c, y, x)
    assert data.test_x[2, 1, 4, 9].item() == cifar_pixel(1002, 1, 4, 9)
    assert (data.crop_padding, data.flip, data.in_channels) == (4, True, 3)


def test_cifar_normalize_uses_the_channel_statistics(tmp_path):
    data = datasets.load_cifar10(write_cifar_dir(tmp_path))
    x = data.normalize(data.train_x[:1])
    expected = (cifar_pixel(0, 1, 2, 3) / 255.0 - datasets.CIFAR_MEAN[1]) / datasets.CIFAR_STD[1]
    assert x[0, 1, 2, 3].item() == pytest.approx(expected, rel=1e-5)


def test_cifar_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare.sh"):
        datasets.load_cifar10(tmp_path / "nowhere")
    folder = write_cifar_dir(tmp_path)
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="data_batch_3"):
        datasets.load_cifar10(folder)
    with open(folder / "data_batch_3", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, fh)
    with pytest.raises(ValueError, match=r"data_batch_3.*\(N, 3072\)"):
        datasets.load_cifar10(folder)
    (folder / "test_batch").unlink()
    assert not datasets.cifar_is_prepared(folder)
    assert datasets.resolve("auto", folder) == "digits"
    write_cifar_batch(folder / "test_batch", 0, 1)
    write_cifar_batch(folder / "data_batch_3", 0, 1)
    assert datasets.resolve("auto", folder) == "cifar10"


# --------------------------------------------------------------------------- digits


def test_digits_split_is_fixed_and_holds_every_row_once():
    first, second = datasets.load_digits(), datasets.load_digits()
    assert first.train_x.shape == (1437, 1, 8, 8) and first.test_x.shape == (360, 1, 8, 8)
    assert torch.equal(first.test_x, second.test_x) and torch.equal(first.train_y, second.train_y)
    counts = torch.bincount(torch.cat([first.train_y, first.test_y]), minlength=10).tolist()
    assert counts == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]  # the UCI test part's class counts
    assert int(first.train_x.max()) <= 16 and (first.crop_padding, first.flip) == (1, False)
    x = first.normalize(first.train_x)
    assert abs(x.mean().item()) < 1e-4 and abs(x.std().item() - 1) < 1e-3  # statistics of the training split


def test_shards_are_disjoint_and_cover_the_training_set():
    n = 250
    base = datasets.Dataset(
        "numbers",
        torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1),
        torch.arange(n),
        torch.zeros(1, 1, 1, 1, dtype=torch.uint8),
        torch.zeros(1, dtype=torch.long),
        scale=1.0,
        mean=(0.0,),
        std=(1.0,),
        crop_padding=0,
        flip=False,
    )
    parts = [set(base.shard(i, 3, seed=5).train_y.tolist()) for i in range(3)]
    assert sorted(len(p) for p in parts) == [83, 83, 84]
    assert set.union(*parts) == set(range(n)) and sum(map(len, parts)) == n
    assert parts[1] == set(base.shard(1, 3, seed=5).train_y.tolist())  # every node computes the same split
    shard = base.shard(2, 3, seed=5)
    assert torch.equal(shard.train_x.view(-1).long(), shard.train_y)  # images stay with their labels
    with pytest.raises(ValueError, match="shard index"):
        base.shard(3, 3)


# --------------------------------------------------------------------------- augmentation and batches


def test_random_crop_is_a_window_of_the_zero_padded_image():
    g = torch.Generator().manual_seed(1)
    x = torch.arange(1, 1 + 8 * 2 * 5 * 5, dtype=torch.float32).view(8, 2, 5, 5)
    out = datasets.augment(x, padding=2, flip=False, generator=g)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    offsets = set()
    for i in range(8):
        matches = [
            (dy, dx)
            for dy in range(5)
            for dx in range(5)
            if torch.equal(out[i], padded[i, :, dy : dy + 5, dx : dx + 5])
        ]
        assert len(matches) == 1, f"image {i} is not a crop"
        offsets.add(matches[0])
    assert len(offsets) > 1  # the offsets vary between images


def test_flip_mirrors_some_images_and_leaves_the_others():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 3, 4, 4)
    out = datasets.augment(x, padding=0, flip=True, generator=g)
    mirrored = [torch.equal(out[i], x[i].flip(2)) for i in range(64)]
    kept = [torch.equal(out[i], x[i]) for i in range(64)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True))
    assert any(mirrored) and any(kept)


def test_training_batches_are_full_and_test_batches_cover_everything():
    data = datasets.load_digits()
    g = torch.Generator().manual_seed(0)
    sizes = [len(y) for _, y in datasets.batches(data, 100, g)]
    assert sizes == [100] * 14 and datasets.steps_per_epoch(data, 100) == 14  # 1437 // 100; the rest is dropped
    test = list(datasets.batches(data, 100, None, train=False))
    assert [len(y) for _, y in test] == [100, 100, 100, 60]
    assert torch.equal(torch.cat([y for _, y in test]), data.test_y)


# --------------------------------------------------------------------------- models and evaluation


@pytest.mark.parametrize("name", models.MODELS)
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 32, 32)])
def test_models_take_digits_and_cifar_shapes(name, shape):
    net = models.build(name, in_channels=shape[0])
    assert net(torch.randn(2, *shape)).shape == (2, 10)


def test_model_sizes_match_what_the_docs_say():
    assert models.count_parameters(models.build("resnet18", 3)) == 11_172_170  # the original example's ResNet-18
    assert models.count_parameters(models.build("small", 3)) < 100_000
    with pytest.raises(ValueError, match="unknown model 'resnet50'"):
        models.build("resnet50", 3)


def _filled_checkpoint(path, value, width=4):
    data = datasets.load_digits()
    net = models.build("small", 1, width=width)
    with torch.no_grad():
        for t in list(net.parameters()) + [b for b in net.buffers() if b.is_floating_point()]:
            t.fill_(value)
        for _, b in net.named_buffers():
            if not b.is_floating_point():
                b.fill_(int(value) * 10)
    torch.save(evaluate.checkpoint(net, "small", width, data), path)


def test_average_of_checkpoints_is_the_arithmetic_mean(tmp_path):
    _filled_checkpoint(tmp_path / "a.pt", 1.0)
    _filled_checkpoint(tmp_path / "b.pt", 3.0)
    saved = evaluate.average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])
    for key, tensor in saved["state_dict"].items():
        if tensor.is_floating_point():
            assert torch.all(tensor == 2.0), key
        else:
            assert torch.all(tensor == 10), key  # counters come from the first checkpoint
    evaluate.build_from(saved)  # loads into the model it names
    _filled_checkpoint(tmp_path / "c.pt", 1.0, width=8)
    with pytest.raises(ValueError, match="c.pt: a different model"):
        evaluate.average_checkpoints([tmp_path / "a.pt", tmp_path / "c.pt"])
    (tmp_path / "d.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="d.pt"):
        evaluate.average_checkpoints([tmp_path / "d.pt"])


# --------------------------------------------------------------------------- train.py on CIFAR-format files


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_py_runs_on_cifar_files_and_writes_metrics_and_weights(tmp_path):
    """One node (so no peer: every update is 'no_fetch') trains the ResNet-18 for two tiny
    epochs on CIFAR-format files written here; checks the run outputs, not accuracy."""
    folder = write_cifar_dir(tmp_path / "cifar", per_batch=4, test=3)
    config = tmp_path / "one.json"
    config.write_text(json.dumps(make_config(1)))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(EXAMPLE / "train.py"),
        "--config",
        str(config),
        "--name",
        "w0",
        "--data",
        "cifar10",
        "--data-dir",
        str(folder),
        "--model",
        "resnet18",
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--run-dir",
        str(run_dir),
        "--log-every",
        "1",
        "--linger-s",
        "0",
        "--device",
        "cpu",
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics" / "w0.jsonl").read_text().splitlines()]
    kinds = [line["kind"] for line in lines]
    epoch = ["step"] * 5 + ["barrier", "checkpoint", "eval"]
    assert kinds == ["start", "barrier"] + epoch + epoch + ["barrier", "end"]
    barriers = [line for line in lines if line["kind"] == "barrier"]
    assert [b["name"] for b in barriers] == ["start", "epoch", "epoch", "exit"]
    assert all(b["skipped"] == [] for b in barriers)  # alone, nobody is missing
    checkpoints = [line for line in lines if line["kind"] == "checkpoint"]
    assert [(c["epoch"], c["step"]) for c in checkpoints] == [(1, 5), (2, 10)]
    assert lines[0]["model"] == "resnet18" and lines[0]["steps_per_epoch"] == 5 and lines[0]["train_images"] == 20
    assert lines[-1]["reason"] == "done" and lines[-1]["averaged"] == 0 and lines[-1]["failed"] == 0
    assert all(0.0 <= line["test_acc"] <= 1.0 for line in lines if line["kind"] == "eval")
    saved = evaluate.load_checkpoint(run_dir / "models" / "w0.pt")
    assert saved["model"] == "resnet18" and saved["data"] == "cifar10" and saved["in_channels"] == 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_py_stopped_while_waiting_at_a_barrier_saves_its_state_and_exits_at_once(tmp_path):
    """A node of a two-node cluster whose peer never comes waits at the start barrier (its time limit:
    300 s). SIGTERM, as torchrun or stop.sh send it, ends the wait: the node records the barrier as
    stopped, saves its state for a restart and exits 0, long before the barrier's limit."""
    import signal

    from dpwa.runfiles import checkpoints

    config = tmp_path / "two.json"
    config.write_text(json.dumps(make_config(2)))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(EXAMPLE / "train.py"),
        "--config",
        str(config),
        "--name",
        "w0",
        "--data",
        "digits",
        "--epochs",
        "2",
        "--run-dir",
        str(run_dir),
        "--linger-s",
        "0",
        "--device",
        "cpu",
        "--barrier-timeout-s",
        "300",
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = run_dir / "metrics" / "w0.jsonl"
        assert wait_until(lambda: lines.exists() and '"kind": "start"' in lines.read_text(), 60)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)  # well within the barrier's 300 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    barrier = [r for r in records if r["kind"] == "barrier"]
    assert [(b["name"], b["skipped"], b.get("stopped")) for b in barrier] == [("start", ["w1"], True)]
    assert records[-1]["kind"] == "end" and records[-1]["reason"] == "stopped by SIGTERM"
    state = checkpoints.load(run_dir, checkpoints.LAST, "w0")
    assert state["progress"]["epoch"] == 0 and state["dpwa"]["barriers"] == {"start": 1}


# --------------------------------------------------------------------------- many nodes: schedule.py


def test_the_learning_rate_grows_with_the_nodes_after_a_warm_up():
    import schedule as training_schedule

    assert training_schedule.learning_rate("digits", 2) == (0.05, 1.0)
    assert training_schedule.learning_rate("digits", 1) == (0.05, 1.0)
    assert training_schedule.learning_rate("digits", 8) == (0.2, 4.0)
    assert training_schedule.learning_rate("digits", 64) == (0.4, 8.0)  # at most 8 times
    assert training_schedule.learning_rate("digits", 8, lr=0.01) == (0.01, 1.0)  # --lr is used as given
    assert training_schedule.learning_rate("cifar10", 8) == (0.1, 1.0)  # not measured there: off
    assert training_schedule.warmup_steps(1.0, 22, 440) == 0
    assert training_schedule.warmup_steps(4.0, 5, 100) == 5 and training_schedule.warmup_steps(4.0, 50, 100) == 10
    factors = [training_schedule.lr_factor(s, 100, 5) for s in range(100)]
    assert factors[:5] == pytest.approx([k / 5 * 0.5 * (1 + np.cos(np.pi * (k - 1) / 100)) for k in range(1, 6)])
    assert factors[5] == pytest.approx(0.5 * (1 + np.cos(np.pi * 5 / 100)))
    assert max(factors) == factors[4] and factors[-1] < 0.001  # up, then the cosine down to 0
    assert training_schedule.lr_factor(0, 440, 0) == 1.0
    # each node takes at least 100 steps: more epochs when the shards are tiny
    assert [training_schedule.default_epochs("digits", s) for s in (22, 5, 2)] == [20, 20, 50]


def test_too_few_steps_for_the_epochs_asked_are_named(capsys):
    import cluster
    import schedule as training_schedule

    warning = training_schedule.few_steps_warning("digits", 8, 179, 32, 5, 5)
    assert warning == (
        "5 epochs of 5 steps (a shard of 179 digits images in batches of 32, 8 nodes) give each "
        "node 25 steps, and digits needs at least 100 to train well: expect a low accuracy. Give "
        "--epochs 20 or more, leave --epochs out, or use fewer nodes"
    )
    assert training_schedule.few_steps_warning("digits", 8, 179, 32, 5, 20) is None
    assert training_schedule.few_steps_warning("cifar10", 8, 6250, 128, 48, 1) is None
    cluster.warn_few_steps(cluster.parse_args(["--nodes", "8", "--epochs", "5"]), "digits", 8)
    assert capsys.readouterr().out == f"dpwa: warning: {warning}\n"  # 1,437 // 8 = 179 images, 5 batches of 32
    cluster.warn_few_steps(cluster.parse_args(["--nodes", "8"]), "digits", 8)
    assert capsys.readouterr().out == ""  # the default epochs are enough


def test_resume_changes_only_the_epochs_and_only_upwards_of_what_was_trained(tmp_path, capsys):
    import cluster

    from dpwa.cluster.launch import LaunchSpec

    with pytest.raises(SystemExit):
        cluster.parse_args(["--resume", str(tmp_path), "--lr", "0.1", "--batch-size", "8"])
    assert "only --epochs may change (got --batch-size, --lr)" in capsys.readouterr().err
    spec = LaunchSpec(run_dir=str(tmp_path), config=make_config(2), command=["py", "train.py", "--epochs", "6"])
    command = spec.command + ["--resume"]
    assert cluster.with_epochs(tmp_path, spec, command, 4, 10) == ["py", "train.py", "--resume", "--epochs", "10"]
    assert cluster.with_epochs(tmp_path, spec, command, 4, 5)[-2:] == ["--epochs", "5"]  # fewer than 6, more than 4
    assert "the run trains 5 epochs in all (it was started with 6)" in capsys.readouterr().out
    with pytest.raises(
        ValueError,
        match=r"has trained 4 epochs; --epochs 4 must be more than that to train on "
        r"\(leave --epochs out to train to 6\)",
    ):
        cluster.with_epochs(tmp_path, spec, command, 4, 4)
    default = LaunchSpec(run_dir=str(tmp_path), config=make_config(2), command=["py", "train.py", "--resume"])
    with pytest.raises(ValueError, match="to train to its default"):
        cluster.with_epochs(tmp_path, default, default.command, 3, 2)


# --------------------------------------------------------------------------- train.py and evaluate.py on charlm


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_py_trains_charlm_on_a_text_file_and_evaluate_and_plot_read_it(tmp_path):
    """One node trains the tiny charlm model for two epochs of 3 steps on a text file written here; its eval
    lines carry the validation loss, evaluate.py averages its weights, and curves.png shows validation loss."""
    text = tmp_path / "text.txt"
    text.write_bytes(b"def f(x):\n    return x + 1\n" * 500)  # 13,500 bytes: 12,150 training, 1,350 validation
    config = tmp_path / "one.json"
    config.write_text(json.dumps(make_config(1)))
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        str(EXAMPLE / "train.py"),
        "--config",
        str(config),
        "--name",
        "w0",
        "--workload",
        "charlm",
        "--data",
        f"text:{text}",
        "--model",
        "tiny",
        "--epochs",
        "2",
        "--steps-per-epoch",
        "3",
        "--batch-size",
        "4",
        "--run-dir",
        str(run_dir),
        "--log-every",
        "1",
        "--linger-s",
        "0",
        "--device",
        "cpu",
    ]
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics" / "w0.jsonl").read_text().splitlines()]
    assert lines[0]["model"] == "tiny" and lines[0]["train_chars"] == 12_150 and lines[0]["steps_per_epoch"] == 3
    evals = [line for line in lines if line["kind"] == "eval"]
    assert [e["step"] for e in evals] == [3, 6]
    for e in evals:
        assert e["test_loss"] == e["val_loss"] > 0 and e["bits_per_char"] == pytest.approx(e["val_loss"] / np.log(2))
    assert lines[-1]["reason"] == "done"
    env = dict(os.environ, PYTHONPATH=f"{CHECKOUT_PATH}{os.pathsep}{EXAMPLE}")
    average = subprocess.run(
        [sys.executable, str(EXAMPLE / "evaluate.py"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert average.returncode == 0, average.stderr
    result = json.loads(average.stdout.strip().splitlines()[-1])
    assert result["data"] == f"text:{text}" and result["val_loss"] == pytest.approx(evals[-1]["val_loss"], rel=1e-4)
    from dpwa.cluster.plot import draw

    assert draw(run_dir).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_workload_and_data_options_agree(tmp_path):
    import text as texts

    assert texts.resolve_workload(None, "stdlib", tmp_path) == ("charlm", "stdlib")
    assert texts.resolve_workload("charlm", "auto", tmp_path) == ("charlm", "stdlib")
    assert texts.resolve_workload(None, "auto", tmp_path) == ("digits", "digits")  # no CIFAR-10 here
    assert texts.resolve_workload("digits", "auto", tmp_path) == ("digits", "digits")
    with pytest.raises(ValueError, match="must be stdlib or text:PATH"):
        texts.resolve_workload("charlm", "digits", tmp_path)
    with pytest.raises(ValueError, match="disagree"):
        texts.resolve_workload("cifar10", "text:x.txt", tmp_path)
