#!/usr/bin/env python3
"""Where the suite's time goes, from a run's JUnit XML: the slowest tests, the time per file, per lane and per kind.

    .venv/bin/python -m pytest --junitxml=/tmp/run.xml ...   # or ./test.sh --junitxml=/tmp/run.xml
    .venv/bin/python scripts/suite-times.py /tmp/run.xml [--top 30]

Prints Markdown (docs/testing.md quotes it). A test's time is its setup, call and teardown together, as JUnit
records it. Its lane (unit, io, slow) comes from the markers, read by collecting the suite in this checkout;
its kind (unit, one process, multi-process, end-to-end, browser, comparison) from the lane and the file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The slow tests by kind, by file: what runs whole commands as a user does, what compares or benchmarks
# training systems, what drives a browser. Every other slow test starts processes of nodes (multi-process).
END_TO_END = {
    "test_cluster.py",
    "test_cli.py",
    "test_install.py",
    "test_launch.py",
    "test_minimal_example.py",
    "test_run_command.py",
    "test_torchrun.py",
    "test_walkthrough.py",
    "test_integrations.py",
    "test_example_data.py",
    "test_prepare.py",
    "test_run_files.py",
}
COMPARISON_PREFIXES = ("test_compare", "test_bench", "test_diloco", "test_systems_")
BROWSER = {  # the tests that drive headless Chromium
    "test_the_page_shows_hostile_names_and_text_as_text",
    "test_run_sh_dashboard_shows_a_live_3_node_run_with_chaos_in_a_browser",
}


def lanes() -> dict[str, str]:
    """Node id -> "slow" / "io" / "unit", as the markers of this checkout say (tests/helpers/lanes.py)."""
    found: dict[str, str] = {}
    for lane, expression in (("slow", "slow"), ("io", "io and not slow")):
        listed = subprocess.run(
            [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-m", expression],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        for line in listed.splitlines():
            if "::" in line:
                found[line.strip()] = lane
    return found


def kind_of(nodeid: str, lane: str) -> str:
    file = nodeid.split("::")[0].rsplit("/", 1)[-1]
    if nodeid.split("::")[-1].split("[")[0] in BROWSER:
        return "browser"
    if lane == "unit":
        return "unit"
    if lane == "io":
        return "one process"
    if file.startswith(COMPARISON_PREFIXES):
        return "comparison"
    if file in END_TO_END:
        return "end-to-end"
    return "multi-process"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    root = ET.parse(args.junit).getroot()
    times: dict[str, float] = {}
    for case in root.iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        times[f"{file}::{case.get('name')}"] = float(case.get("time", 0))
    by_lane = lanes()
    total = sum(times.values())
    print(f"{len(times)} tests, {total:.0f} s in all ({total / 60:.1f} min of test time)\n")

    print(f"### The {args.top} slowest tests\n\n| s | test |\n|---:|---|")
    for nodeid, t in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {t:.1f} | `{nodeid}` |")

    per_file: dict[str, list[float]] = defaultdict(list)
    per_kind: dict[str, list[float]] = defaultdict(list)
    for nodeid, t in times.items():
        per_file[nodeid.split("::")[0]].append(t)
        per_kind[kind_of(nodeid, by_lane.get(nodeid, "unit"))].append(t)
    print("\n### Time per kind\n\n| kind | tests | s | share |\n|---|---:|---:|---:|")
    for kind, ts in sorted(per_kind.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {kind} | {len(ts)} | {sum(ts):.0f} | {100 * sum(ts) / total:.0f}% |")
    print("\n### Time per file\n\n| file | tests | s | share |\n|---|---:|---:|---:|")
    for file, ts in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        print(f"| `{file}` | {len(ts)} | {sum(ts):.1f} | {100 * sum(ts) / total:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
