"""Checkpoints: atomic files, a manifest with their hashes, completeness, and loading that unpickles nothing."""

from __future__ import annotations

import json
import os
import pickle

import pytest

torch = pytest.importorskip("torch")

from dpwa.cluster import checkpoints  # noqa: E402


def state(k: float) -> dict:
    return {"model": {"w": torch.full((3, 2), k)}, "dpwa": {"clock": 10.0 * k, "barriers": {"epoch": int(k)}},
            "rng": {"python": (3, tuple(range(5)), None)}, "progress": {"epoch": int(k), "step": 7}}


def test_save_then_load_round_trips_and_the_manifest_lists_each_file(tmp_path):
    for node in ("w1", "w2"):
        checkpoints.save(tmp_path, 1, node, state(1.0))
    manifest = checkpoints.manifest(tmp_path, 1)
    assert manifest["epoch"] == 1 and sorted(manifest["files"]) == ["w1", "w2"]
    assert len(manifest["files"]["w1"]["sha256"]) == 64
    loaded = checkpoints.load(tmp_path, 1, "w2")
    assert torch.equal(loaded["model"]["w"], torch.full((3, 2), 1.0))
    assert loaded["dpwa"] == {"clock": 10.0, "barriers": {"epoch": 1}} and loaded["rng"]["python"][1] == (0, 1, 2, 3, 4)
    assert not [p for p in (tmp_path / "checkpoints" / "epoch-1").iterdir() if p.name.endswith(".tmp")]


def test_the_latest_complete_epoch_has_every_nodes_file(tmp_path):
    assert checkpoints.latest_complete(tmp_path, ["w1", "w2"]) is None
    for epoch in (1, 2):
        for node in ("w1", "w2"):
            checkpoints.save(tmp_path, epoch, node, state(epoch))
    checkpoints.save(tmp_path, 3, "w1", state(3))  # w2 died before it saved epoch 3
    assert checkpoints.latest_complete(tmp_path, ["w1", "w2"]) == 2
    assert checkpoints.latest_complete(tmp_path, ["w1"]) == 3
    (tmp_path / "checkpoints" / "epoch-2" / "w2.pt").unlink()  # listed, but gone
    assert checkpoints.latest_complete(tmp_path, ["w1", "w2"]) == 1


def test_a_damaged_or_replaced_file_is_refused_by_its_hash(tmp_path):
    path = checkpoints.save(tmp_path, 4, "w1", state(4))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoints.CheckpointError, match=r"w1\.pt: its SHA-256 does not match the manifest"):
        checkpoints.load(tmp_path, 4, "w1")
    with pytest.raises(checkpoints.CheckpointError, match="no checkpoint of w9 for epoch 4"):
        checkpoints.load(tmp_path, 4, "w9")


class Payload:
    """What an attacker would pickle: unpickling it runs code."""

    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_loading_unpickles_nothing_but_tensors_and_plain_data(tmp_path):
    """A checkpoint that holds an arbitrary object, with a manifest whose hash matches it, is still
    refused: torch.load(weights_only=True) will not build it."""
    path = checkpoints.save(tmp_path, 5, "w1", state(5))
    evil = pickle.dumps({"model": Payload()})
    buffer = __import__("io").BytesIO()
    torch.save({"model": {"w": torch.zeros(1)}}, buffer)  # a real torch zip, then its pickle replaced
    import zipfile

    source = zipfile.ZipFile(buffer)
    out = __import__("io").BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for item in source.infolist():
            target.writestr(item, evil if item.filename.endswith("data.pkl") else source.read(item.filename))
    path.write_bytes(out.getvalue())
    manifest_path = tmp_path / "checkpoints" / "epoch-5" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["w1"]["sha256"] = __import__("hashlib").sha256(out.getvalue()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(checkpoints.CheckpointError, match="not a safe checkpoint"):
        checkpoints.load(tmp_path, 5, "w1")


def test_names_and_epochs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="a node name is"):
        checkpoints.save(tmp_path, 1, "../w1", state(1))
    with pytest.raises(ValueError, match="epoch must be"):
        checkpoints.save(tmp_path, -1, "w1", state(1))
