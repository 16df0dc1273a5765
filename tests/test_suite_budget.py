"""The suite's budget: how many tests may be slow is written in one place (helpers/lanes.py), and checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT
from helpers import lanes


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
