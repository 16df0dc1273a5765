"""prepare.sh: download, MD5 check and unpacking of CIFAR-10, on archives this test builds (no network)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile

import pytest

from example_helpers import CIFAR_FILES, EXAMPLE, write_cifar_dir

PREPARE = EXAMPLE / "prepare.sh"
REAL_MD5 = "c58f30108f718f92721af3b95e74349a"

pytestmark = pytest.mark.skipif(shutil.which("tar") is None, reason="prepare.sh needs tar")


def tiny_archive(tmp_path):
    """A cifar-10-python.tar.gz in the real layout, holding tiny batches; returns (path, md5)."""
    source = write_cifar_dir(tmp_path / "src")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="cifar-10-batches-py")
    return archive, hashlib.md5(archive.read_bytes()).hexdigest()


def prepare(target, **env):
    return subprocess.run(
        ["bash", str(PREPARE), str(target)], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


@pytest.mark.io
def test_an_unreachable_url_fails_with_what_to_do(tmp_path):
    done = prepare(tmp_path / "data", CIFAR10_URL=f"file://{tmp_path}/missing.tar.gz")
    assert done.returncode == 1
    assert "cannot download" in done.stderr
    assert f"copy it to {tmp_path}/data/cifar-10-python.tar.gz" in done.stderr
    assert not (tmp_path / "data" / "cifar-10-python.tar.gz").exists()  # no partial file left behind
    assert not (tmp_path / "data" / "cifar-10-python.tar.gz.part").exists()


@pytest.mark.skipif(shutil.which("curl") is None, reason="file:// downloads need curl")
@pytest.mark.io
def test_download_verify_and_unpack(tmp_path):
    archive, md5 = tiny_archive(tmp_path)
    target = tmp_path / "data"
    done = prepare(target, CIFAR10_URL=f"file://{archive}", CIFAR10_MD5=md5)
    assert done.returncode == 0, done.stderr
    assert f"MD5 verified ({md5})" in done.stdout
    assert sorted(p.name for p in (target / "cifar-10-batches-py").iterdir()) == sorted(CIFAR_FILES)
    import data as datasets

    assert len(datasets.load_cifar10(target / "cifar-10-batches-py").train_y) == 20
    again = prepare(target, CIFAR10_URL="file:///nowhere", CIFAR10_MD5=md5)
    assert again.returncode == 0 and "already prepared" in again.stdout


@pytest.mark.io
def test_an_archive_with_the_wrong_checksum_is_refused_and_not_unpacked(tmp_path):
    archive, md5 = tiny_archive(tmp_path)
    target = tmp_path / "data"
    target.mkdir()
    shutil.copy(archive, target / "cifar-10-python.tar.gz")  # copied in by hand, as on a machine without internet
    done = prepare(target)  # checked against the real CIFAR-10 MD5
    assert done.returncode == 1
    assert f"has MD5 {md5}, expected {REAL_MD5}" in done.stderr
    assert not (target / "cifar-10-batches-py").exists()
