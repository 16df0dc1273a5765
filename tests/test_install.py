"""dpwa works from a pip-installed wheel, outside the checkout, and its lab from a wheel of its own.

The test builds the library's wheel (``pip wheel --no-deps .``: it must hold no
lab module, and hold ``dpwa/py.typed``) and the lab's (``pip wheel --no-deps
lab``, the distribution dpwa-lab: the lab and its embedded data), installs the
library (without dependencies) into a fresh virtual environment that borrows
the dependencies of .venv, checks that ``python -m dpwa.compare`` then says in
one line what to install, installs the lab, and runs ``python -m dpwa.bench
--quick`` and ``python -m dpwa.compare --quick`` from a folder far from the
repository, checking that dpwa and dpwa_lab were imported from that
environment, not from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

# under parallel workers one worker runs all of this module's tests (tests/helpers/workers.py)
pytestmark = [pytest.mark.slow]


@dataclass(frozen=True)
class Wheels:
    library: list[str]  # the names in the library's wheel (dpwa-*.whl)
    lab: list[str]  # the names in the lab's wheel (dpwa_lab-*.whl)
    without_lab: subprocess.CompletedProcess  # python -m dpwa.compare --help before the lab was installed


# what each wheel is built from, copied out of the checkout first: pip builds in the source tree, and a build/
# folder left there by an earlier build (of a module since moved or removed) would go into the wheel
SOURCES = {"library": ("pyproject.toml", "README.md", "dpwa"), "lab": ("lab/pyproject.toml", "lab/dpwa_lab")}
NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info")


def build_wheel(which: str, base: Path, pattern: str) -> Path:
    """``pip wheel --no-deps`` of the library or the lab (:data:`SOURCES`), into base/dist-WHICH; the wheel's path."""
    source, dist = base / f"src-{which}", base / f"dist-{which}"
    for name in SOURCES[which]:
        origin, copy = ROOT / name, source / Path(name).relative_to("lab" if which == "lab" else ".")
        if origin.is_dir():
            shutil.copytree(origin, copy, ignore=NOT_SOURCE)
        else:
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, copy)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        env=without_pythonpath(),
    )
    assert built.returncode == 0, f"pip wheel of {which} ({', '.join(SOURCES[which])}): {built.stderr}"
    wheels = list(dist.glob(pattern))
    assert len(wheels) == 1, f"{dist}: expected one {pattern} from {source}, got {wheels}"
    return wheels[0]


def pip_install(python: Path, wheel: Path) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=without_pythonpath(),  # else a checkout on PYTHONPATH (its dpwa.egg-info) reads as dpwa installed
    )
    assert done.returncode == 0, f"pip install {wheel.name}: {done.stderr}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtual environment with the wheels of this checkout installed, the library's and then the lab's; (its
    python, a folder to run in, what the wheels held and what the library said without its lab)."""
    base = tmp_path_factory.mktemp("install")
    library = build_wheel("library", base, "dpwa-*.whl")
    lab = build_wheel("lab", base, "dpwa_lab-*.whl")
    env_dir = base / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # the dependencies (torch, pyzmq, ...) come from .venv's site-packages; .pth files there (the checkout's
    # editable install) are not processed for a path added this way
    ours = subprocess.run(
        [str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (Path(ours) / "borrowed.pth").write_text(site.getsitepackages()[0] + "\n")
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    pip_install(python, library)
    without_lab = run((python, elsewhere), "-m", "dpwa.compare", "--help", timeout=120)
    pip_install(python, lab)
    with zipfile.ZipFile(library) as one, zipfile.ZipFile(lab) as other:
        wheels = Wheels(library=one.namelist(), lab=other.namelist(), without_lab=without_lab)
    return python, elsewhere, wheels


def without_pythonpath() -> dict[str, str]:
    """This environment without PYTHONPATH: what runs from the install sees no checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run(installed, *args, timeout=420):
    python, cwd = installed[:2]
    return subprocess.run(
        [str(python), *args], cwd=cwd, env=without_pythonpath(), capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.timeout(600)
def test_the_library_and_its_lab_are_wheels_of_their_own_imported_from_the_install_not_the_checkout(installed):
    """The library's wheel holds no lab module (nor the lab's data) and holds its PEP 561 marker; the lab's wheel
    holds the lab, its data and its marker. With the library alone, python -m dpwa.compare says in one line what
    to install; with both, each is imported from the install, and the lab's console scripts run."""
    wheels = installed[2]
    modules = [name for name in wheels.library if name.endswith(".py")]
    assert "dpwa/__init__.py" in modules and "dpwa/compare.py" in modules, modules
    assert [name for name in wheels.library if name.startswith(("dpwa_lab/", "dpwa/lab/", "dpwa/data/"))] == []
    assert "dpwa/py.typed" in wheels.library
    assert {"dpwa_lab/compare/__main__.py", "dpwa_lab/data/digits.csv.gz", "dpwa_lab/py.typed"} <= set(wheels.lab)
    assert [name for name in wheels.lab if name.startswith("dpwa/")] == [], "the lab's wheel holds no library module"

    said = wheels.without_lab
    assert said.returncode == 2 and said.stdout == "", (said.returncode, said.stdout, said.stderr)
    assert said.stderr.splitlines() == [
        "python -m dpwa.compare: the lab (package dpwa_lab, distribution dpwa-lab) is not installed; "
        "from a dpwa checkout: pip install -e . -e lab"
    ]

    done = run(installed, "-c", "import dpwa, dpwa_lab.workloads.images as i; print(dpwa.__file__); print(i.__file__)")
    assert done.returncode == 0, done.stderr
    paths = done.stdout.split()
    assert len(paths) == 2, paths
    for path in paths:
        assert "site-packages" in path and not path.startswith(str(ROOT)), path

    bin_dir = Path(installed[0]).parent  # the lab's console scripts: the same commands under their own names
    assert all((bin_dir / name).is_file() for name in ("dpwa-compare", "dpwa-bench", "dpwa-sim")), sorted(
        p.name for p in bin_dir.iterdir()
    )
    helped = subprocess.run(
        [str(bin_dir / "dpwa-sim"), "--help"], env=without_pythonpath(), capture_output=True, text=True, timeout=120
    )
    assert helped.returncode == 0 and "consensus" in helped.stdout, helped.stdout + helped.stderr


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
