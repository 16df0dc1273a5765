"""The suite's budget: how many tests may be slow is written in one place (helpers/lanes.py), and checked."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import ROOT
from helpers import lanes, workers


def collected(expression: str) -> list[str]:
    """The node ids `pytest -m EXPRESSION` would run, from a collection of the whole suite in this checkout."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-m", expression, "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, f"pytest --co -m {expression!r} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_the_count_of_slow_tests_stays_within_its_budget():
    slow = collected("slow")
    assert slow, "no test is marked slow: the collection found nothing"
    assert len(slow) <= lanes.SLOW_TESTS_MAX, (
        f"{len(slow)} tests are marked slow, past the budget of {lanes.SLOW_TESTS_MAX} "
        "(SLOW_TESTS_MAX in tests/helpers/lanes.py). Make the new test faster (a unit or io test: "
        "docs/testing.md, 'The lanes'), or raise the number there and say in docs/testing.md why."
    )


def test_every_module_that_builds_once_for_its_tests_runs_on_one_worker():
    """A module- or session-scoped fixture in a test module is built once per worker that runs any of its tests:
    such a module is in ONE_WORKER_MODULES (helpers/workers.py), or two workers would each build it."""
    shared = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"""scope\s*=\s*["'](module|session)["']""", path.read_text())
    }
    assert "tests/test_compare.py" in shared  # the search finds what it is for
    assert shared <= workers.ONE_WORKER_MODULES, (
        f"add to ONE_WORKER_MODULES: {sorted(shared - workers.ONE_WORKER_MODULES)}"
    )
    assert all((ROOT / path).is_file() for path in workers.ONE_WORKER_MODULES)


@pytest.mark.parametrize(
    "nodeid, scope",
    [
        ("tests/test_compare.py::test_the_json_has_the_documented_shape", "tests/test_compare.py"),
        ("tests/test_install.py::test_the_comparison_runs_from_the_wheel", "tests/test_install.py"),
        ("tests/test_config.py::test_x[a::b]", "tests/test_config.py::test_x[a::b]"),
    ],
)
def test_a_module_that_builds_once_is_one_unit_of_work_and_any_other_test_its_own(nodeid, scope):
    assert workers.OneWorkerPerSharedModule._split_scope(None, nodeid) == scope  # type: ignore[arg-type]
