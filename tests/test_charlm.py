"""The charlm workload: the stdlib split (deterministic, by file, disjoint), text:PATH, shards, batches, the model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dpwa_lab.compare.workload import WorkloadSpec, load_workload
from dpwa_lab.workloads import charlm


def fake_stdlib(root, names):
    """A stdlib folder whose file k holds a text unique to its path (so any byte run says where it came from)."""
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {name}\n" + f"value = {name!r}\n" * 3)
    return root


KEPT = [f"pkg{k}/mod{k}.py" for k in range(30)] + [f"top{k}.py" for k in range(30)] + ["idlelib/editor.py"]
EXCLUDED = [
    "test/test_x.py",
    "unittest/test/test_case.py",
    "lib2to3/tests/data.py",
    "idlelib/idle_test/test_x.py",
    "site-packages/foo.py",
    "pkg1/testing_helpers/thing.py",
]


def test_the_stdlib_files_leave_out_tests_and_site_packages(tmp_path):
    root = fake_stdlib(tmp_path, KEPT + EXCLUDED + ["notes.txt"])
    assert charlm.stdlib_files(root) == sorted(KEPT)


def test_the_split_is_by_file_disjoint_and_does_not_depend_on_the_listing_order(tmp_path):
    root = fake_stdlib(tmp_path / "a", KEPT + EXCLUDED)
    shuffled = list(KEPT)
    random.Random(1).shuffle(shuffled)
    other = fake_stdlib(tmp_path / "b", list(reversed(EXCLUDED)) + shuffled)  # made in another order
    first = charlm.load_stdlib(root, fraction=0.25)
    second = charlm.load_stdlib(other, fraction=0.25)
    assert first.train.tobytes() == second.train.tobytes() and first.valid.tobytes() == second.valid.tobytes()
    expected_valid = {n for n in KEPT if charlm.validation_fraction(n) < 0.25}
    assert 0 < len(expected_valid) < len(KEPT)  # both sides hold files
    train, valid = first.train.tobytes().decode(), first.valid.tobytes().decode()
    for name in KEPT:  # every file is wholly on one side, none on both
        text = (root / name).read_text()
        assert (text in valid, text in train) == ((True, False) if name in expected_valid else (False, True)), name
    for name in EXCLUDED:
        assert name not in train and name not in valid
    # a file's side is a function of its path alone
    assert charlm.validation_fraction("json/decoder.py") == charlm.validation_fraction("json/decoder.py")
    assert first.train_files == len(KEPT) - len(expected_valid) and first.valid_files == len(expected_valid)


def test_the_caps_cut_each_side_and_the_order_is_by_hash(tmp_path):
    root = fake_stdlib(tmp_path, KEPT)
    data = charlm.load_stdlib(root, train_cap=100, valid_cap=50, fraction=0.25)
    assert len(data.train) == 100 and len(data.valid) == 50
    train_files = sorted((n for n in KEPT if charlm.validation_fraction(n) >= 0.25), key=charlm.validation_fraction)
    assert data.train.tobytes() == b"".join((root / n).read_bytes() for n in train_files)[:100]


def test_the_real_stdlib_loads_the_same_twice_with_disjoint_files():
    first, second = charlm.load_stdlib(), charlm.load_stdlib()
    assert np.array_equal(first.train, second.train) and np.array_equal(first.valid, second.valid)
    assert len(first.train) == charlm.TRAIN_CAP_BYTES and len(first.valid) == charlm.VALID_CAP_BYTES
    files = charlm.stdlib_files()
    assert len(files) > 300 and not [f for f in files if "/test/" in f"/{f}" or "site-packages" in f]
    valid = {f for f in files if charlm.validation_fraction(f) < charlm.VALID_FRACTION}
    assert 0.03 < len(valid) / len(files) < 0.2  # about a tenth of the files, by hash


def test_a_text_file_is_split_by_position(tmp_path):
    path = tmp_path / "mine.txt"
    content = bytes(range(32, 127)) * 11  # 1,045 bytes
    path.write_bytes(content)
    data = charlm.load(f"text:{path}")
    n_valid = 105  # ceil(10% of 1,045)
    assert data.source == f"text:{path}"
    assert data.train.tobytes() == content[:-n_valid] and data.valid.tobytes() == content[-n_valid:]


def test_a_text_file_trains_through_the_comparisons_workload(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 400)  # 18,000 bytes
    spec = WorkloadSpec(
        data=f"text:{path}",
        data_dir="",
        workers=2,
        epochs=1,
        steps=5,
        batch_size=4,
        lr=0.1,
        model="tiny",
        workload="charlm",
        eval_windows=8,
    )
    w = load_workload(spec)
    assert w.metric == "loss" and w.describe()["train_chars"] == 16_200
    assert str(w.device_of(1)) == "cpu" and next(w.worker_model(1).parameters()).device.type == "cpu"
    batches = list(w.train_batches(1))
    assert len(batches) == 5 and batches[0][0].shape == (4, 32) and batches[0][0].dtype == torch.int64
    net = w.build_model()
    loss = w.loss(net, batches[0])
    loss.backward()
    from dpwa_lab.systems.layout import ModuleView

    acc, val = w.evaluator()(ModuleView(net).state())
    assert 0 <= acc <= 1 and abs(val - np.log(256)) < 1.0  # an untrained model: about uniform over bytes
    segments = w.segment_batches(0, 0)
    assert len(segments) == spec.segment_batches and segments[0][1].shape == (4, 32)


@pytest.mark.parametrize(
    "source, error, words",
    [
        ("text:{tmp}/missing.txt", FileNotFoundError, "missing.txt"),
        ("text:{tmp}/short.txt", ValueError, "short.txt"),
        ("books", ValueError, "'books'"),
    ],
)
def test_bad_text_sources_are_named(tmp_path, source, error, words):
    (tmp_path / "short.txt").write_bytes(b"x")
    with pytest.raises(error, match=words):
        charlm.load(source.format(tmp=tmp_path))


def test_a_text_too_short_for_a_batch_per_shard_is_refused(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"abc " * 100)
    spec = WorkloadSpec(
        data=f"text:{path}",
        data_dir="",
        workers=4,
        epochs=1,
        steps=5,
        batch_size=32,
        lr=0.1,
        model="tiny",
        workload="charlm",
    )
    with pytest.raises(ValueError, match="smaller than one batch"):
        load_workload(spec)


def test_shards_are_disjoint_and_cover_the_text():
    text = np.arange(1003, dtype=np.int64).astype(np.uint8)
    parts = [charlm.shard(text, i, 4) for i in range(4)]
    assert np.array_equal(np.concatenate(parts), text) and [len(p) for p in parts] == [251, 251, 251, 250]
    with pytest.raises(ValueError, match="0..3"):
        charlm.shard(text, 4, 4)


def test_batches_are_windows_of_the_text_with_targets_shifted_by_one():
    raw = np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8)
    text, context = raw.tobytes(), 16
    made = list(charlm.batches(raw, 4, context, torch.Generator().manual_seed(3)))
    again = list(charlm.batches(raw, 4, context, torch.Generator().manual_seed(3)))
    n = charlm.windows_per_epoch(len(raw), context)
    assert len(made) == n // 4
    starts = []
    for (x, y), (x2, y2) in zip(made, again, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)  # the same seed, the same epoch
        assert torch.equal(y[:, :-1], x[:, 1:])
        for inputs, targets in zip(x, y, strict=True):
            window = bytes(inputs.tolist()) + bytes(targets[-1:].tolist())
            starts.append(text.find(window))  # a contiguous piece of the text
    assert min(starts) >= 0 and len(set(starts)) == len(starts)  # no window twice in an epoch
    assert len({s % context for s in starts}) == 1  # one offset per epoch, windows a context apart


def test_the_model_is_causal_and_counts_its_parameters():
    net = charlm.build("tiny", seed=0)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    with torch.no_grad():
        a, b = net(x), net(changed)
    assert a.shape == (2, 32, 256)
    assert torch.allclose(a[:, :20], b[:, :20]) and not torch.allclose(a[:, 20:], b[:, 20:])
    assert sum(p.numel() for p in charlm.build("small").parameters()) == 191_296
    assert sum(p.numel() for p in net.parameters()) == 30_432
    assert sum(p.numel() for p in charlm.build("medium").parameters()) == 4_935_936  # the GPU check's
    assert not list(net.buffers())
    with pytest.raises(ValueError, match="unknown charlm size 'huge'"):
        charlm.build("huge")
    with pytest.raises(ValueError, match="multiple of heads"):
        charlm.CharLMConfig(dim=30, heads=4)


def test_bits_per_character():
    assert charlm.bits(np.log(2)) == pytest.approx(1.0)
    assert charlm.bits(np.log(256)) == pytest.approx(8.0)


def test_the_device_is_checked_and_cuda_without_a_gpu_is_refused_naming_it(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 400)

    def spec(device: str) -> WorkloadSpec:
        return WorkloadSpec(
            data=f"text:{path}", data_dir="", workers=2, epochs=1, batch_size=4, lr=0.1, model="tiny",
            workload="charlm", eval_windows=8, device=device,
        )  # fmt: skip

    with pytest.raises(ValueError, match="device must be one of cpu, cuda, got 'tpu'"):
        spec("tpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/test_cuda.py covers device cuda")
    w = load_workload(spec("cuda"))
    with pytest.raises(RuntimeError, match="device cuda: torch .* sees no GPU here"):
        w.worker_model(0)
