"""dpwa works from a pip-installed wheel, outside the checkout: the benchmark and the comparison included.

The test builds the wheel, installs it (without dependencies) into a fresh
virtual environment that borrows the dependencies of .venv, and runs
``python -m dpwa.bench --quick`` and ``python -m dpwa.compare --quick`` from a
folder far from the repository, checking that dpwa was imported from that
environment, not from the checkout.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import ROOT

# under parallel workers one worker runs all of this module's tests (tests/helpers/workers.py)
pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtual environment with the wheel of this checkout installed; (its python, a folder to run in)."""
    base = tmp_path_factory.mktemp("install")
    dist = base / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    wheels = list(dist.glob("dpwa-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = base / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # the dependencies (torch, pyzmq, ...) come from .venv's site-packages; .pth files there (the checkout's
    # editable install) are not processed for a path added this way
    ours = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (Path(ours) / "borrowed.pth").write_text(site.getsitepackages()[0] + "\n")
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheels[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return python, elsewhere


def run(installed, *args, timeout=420):
    python, cwd = installed
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(600)
def test_the_package_is_imported_from_the_wheel_not_the_checkout(installed):
    done = run(installed, "-c", "import dpwa, dpwa.lab.workloads.images as i; print(dpwa.__file__); print(i.__file__)")
    assert done.returncode == 0, done.stderr
    for path in done.stdout.split():
        assert "site-packages" in path and not path.startswith(str(ROOT)), path


@pytest.mark.timeout(600)
def test_the_benchmark_runs_from_the_wheel(installed):
    out = installed[1] / "bench.json"
    # only the training rows: the whole --quick benchmark is test_bench.py's, from the checkout
    done = run(installed, "-m", "dpwa.bench", "--quick", "--training", "--json", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["training"] and result["training"][0]["averaged_fraction"] > 0


@pytest.mark.timeout(600)
def test_the_comparison_runs_from_the_wheel(installed):
    out = installed[1] / "compare.json"
    done = run(
        installed,
        "-m",
        "dpwa.compare",
        "--quick",
        "--epochs",
        "1",  # that it runs and completes from the wheel; how well each trains is test_compare.py's
        "--systems",
        "gossip,allreduce",
        "--workers",
        "2",
        "--out",
        str(installed[1] / "run"),
        "--json",
        str(out),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert sorted(report["systems"]) == ["allreduce", "gossip"]
    assert all(system["completed"] for system in report["systems"].values())
