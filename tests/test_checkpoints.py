"""Checkpoints: atomic files, a manifest with their hashes, completeness, and loading that unpickles nothing."""

from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import CHECKOUT_PATH, HELPERS, ROOT, make_config  # noqa: E402
from dpwa.runfiles import checkpoints  # noqa: E402


def state(k: float) -> dict:
    return {
        "model": {"w": torch.full((3, 2), k)},
        "dpwa": {"clock": 10.0 * k, "barriers": {"epoch": int(k)}},
        "rng": {"python": (3, tuple(range(5)), None)},
        "progress": {"epoch": int(k), "step": 7},
    }


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


@pytest.mark.io
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


def _private_tmpfs(disk, size: str, script: str, timeout: float, env: dict | None = None):
    """Run `script` (sh) with a fresh tmpfs of `size` mounted at `disk` ($DISK), in a private mount namespace
    (the mount ends with the namespace; `disk` itself is an empty folder the test's tmp_path owns)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) to mount a small private tmpfs")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare -m is not allowed here: {probe.stderr.decode().strip()}")
    disk.mkdir()
    wrapper = f'mount -t tmpfs -o size={size} tmpfs "$DISK" && {script}'
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", wrapper],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH, DISK=str(disk), **(env or {})),
    )


@pytest.mark.timeout(60)
@pytest.mark.io
def test_a_full_disk_fails_the_save_with_the_file_named_and_leaves_earlier_checkpoints_whole(tmp_path):
    """On a 1 MB tmpfs: a node file that does not fit, then one that fits but whose manifest does not.
    Each raises CheckpointError naming the file and the reason; no temporary or unlisted file stays,
    and epoch 1 stays the latest complete checkpoint, loadable."""
    helper = shlex.quote(str(HELPERS / "full_disk_checkpoints.py"))
    done = _private_tmpfs(tmp_path / "disk", "1m", f'exec {shlex.quote(sys.executable)} {helper} "$DISK"', timeout=50)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["file_error"].endswith(
        "epoch-2/a.pt: could not be written (No space left on device); a's earlier checkpoints are untouched"
    ), result
    assert (
        "epoch-2/manifest.json: could not be written (No space left on device), so b.pt was removed"
        in result["manifest_error"]
    ), result
    assert result["left_in_epoch_2"] == ["manifest.lock"]  # no a.pt, b.pt, manifest or temporary file
    assert result["latest"] == 1 and result["loaded"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_py_on_a_full_disk_trains_to_the_end_and_says_what_it_could_not_save(tmp_path):
    """The example's run folder on a tmpfs filled to the last byte: metrics lines, checkpoints and the
    final weights cannot be written. The node still trains its two epochs and exits 0, and its log
    names each file it could not write."""
    train = shlex.quote(str(ROOT / "examples" / "pytorch-cifar" / "train.py"))
    config = tmp_path / "one.json"  # outside the full disk
    config.write_text(json.dumps(make_config(1)))
    script = (
        f'mkdir "$DISK/run" && (cat /dev/zero > "$DISK/filler" 2>/dev/null; true) && '
        f"exec {shlex.quote(sys.executable)} {train} --config {shlex.quote(str(config))} "
        f'--name w0 --data digits --epochs 2 --run-dir "$DISK/run" --linger-s 0 --device cpu'
    )
    done = _private_tmpfs(tmp_path / "disk", "4m", script, timeout=100, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr
    assert "metrics/w0.jsonl: a metrics line was lost (No space left on device); training goes on" in log, log[-3000:]
    for epoch in (1, 2):
        assert f"checkpoint of epoch {epoch} not saved: " in log and f"epoch-{epoch}/w0.pt: could not be written" in log
    assert "models/w0.pt: final weights not saved (No space left on device)" in log
    assert "w0: done after " in log  # trained every step of both epochs


def rewrite_manifest(run_dir, epoch, change) -> None:
    path = checkpoints.checkpoint_dir(run_dir, epoch) / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "entry, expected",
    [
        ({"file": "../../../victim.txt"}, "'file' must be 'w1.pt'"),
        ({"file": "/etc/passwd"}, "'file' must be 'w1.pt'"),
        ({"file": "w2.pt"}, "'file' must be 'w1.pt'"),  # another node's file
        ({"sha256": "x" * 64}, "'sha256' must be 64 lowercase hex digits"),
        ({"bytes": -1}, "'bytes' must be an integer"),
        ({"saved": "yesterday"}, "'saved' must be a time"),
    ],
)
def test_a_manifest_entry_is_checked_before_any_use_and_nothing_outside_the_folder_is_touched(
    tmp_path, entry, expected
):
    """A manifest entry naming a file outside its folder (or another node's), or with fields of the
    wrong type, is a CheckpointError naming the manifest, the entry and what was expected, for every
    function that reads the manifest; discard() deletes nothing. (Before: "../../../victim.txt" made
    discard(), which train.py calls on resume, delete a file outside the run folder.)"""
    run = tmp_path / "run"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for node in ("w1", "w2"):
        checkpoints.save(run, checkpoints.LAST, node, state(1.0))
    rewrite_manifest(run, checkpoints.LAST, lambda data: data["files"]["w1"].update(entry))
    for call in (
        lambda: checkpoints.discard(run, checkpoints.LAST, "w1"),
        lambda: checkpoints.load(run, checkpoints.LAST, "w1"),
        lambda: checkpoints.manifest(run, checkpoints.LAST),
    ):
        with pytest.raises(checkpoints.CheckpointError, match=rf"manifest\.json: files\['w1'\]: {expected}"):
            call()
    assert checkpoints.has(run, checkpoints.LAST, "w1") is False
    assert checkpoints.latest_complete(run, ["w1", "w2"]) is None
    assert victim.read_text() == "keep me"
    assert (checkpoints.checkpoint_dir(run, checkpoints.LAST) / "w2.pt").is_file()


@pytest.mark.parametrize("bad", [["w1.pt"], "w1.pt", 7, None])
def test_an_entry_that_is_not_a_mapping_is_a_checkpoint_error_not_a_type_error(tmp_path, bad):
    """(Before: latest_complete, has and load crashed with a TypeError.)"""
    checkpoints.save(tmp_path, 2, "w1", state(2.0))
    rewrite_manifest(tmp_path, 2, lambda data: data["files"].update(w1=bad))
    with pytest.raises(checkpoints.CheckpointError, match=r"files\['w1'\]: expected a map"):
        checkpoints.load(tmp_path, 2, "w1")
    assert checkpoints.has(tmp_path, 2, "w1") is False
    assert checkpoints.latest_complete(tmp_path, ["w1"]) is None
