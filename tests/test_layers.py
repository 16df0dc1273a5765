"""The package's layers point only down: no module imports from a layer above its own.

wire, runfiles < mixing < config < gossip < adapters < cluster, systems < tools (compare, bench, sim, cli, workloads),
over a base of logging and counters that every layer may use. A module that is not in the table fails the
test, so a new one is placed on purpose.
"""

from __future__ import annotations

import ast

from conftest import ROOT

RANK = {
    "logs": 0,
    "stats": 0,
    "signals": 0,  # the base: logging, counters, signal handling
    "backoff": 0,  # the one back-off every retry uses
    "wire": 1,
    "runfiles": 1,  # a run folder's private files and metrics lines (the hook writes them, the cluster reads them)
    "mixing": 2,
    "config": 3,
    "gossip": 4,
    "adapters": 5,
    "integrations": 6,  # Lightning and Hugging Face callbacks over the adapter
    "cluster": 6,
    "systems": 6,
    "workloads": 7,
    "compare": 7,
    "bench": 7,
    "sim": 7,
    "cli": 7,  # tools
    "lab": 7,  # dpwa/lab/: systems, workloads, compare, bench and sim, each keeping its rank above
    "__main__": 8,
    "__init__": 8,
}
TOOLS = 7


def imports() -> dict[tuple[str, str], list[str]]:
    """(importer's part, imported part) -> the files where that import is made."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in (ROOT / "dpwa").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        package = list(parts[:-1])
        if parts[1:2] == ("lab",) and len(parts) > 3:  # the lab's packages keep their own layers
            parts = parts[:1] + parts[2:]
        me = parts[1] if len(parts) > 1 else "__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    names = [".".join(base + ([node.module] if node.module else []))]
                else:
                    names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                pieces = name.split(".")
                if pieces[:2] == ["dpwa", "lab"] and len(pieces) > 2:
                    pieces = pieces[:1] + pieces[2:]
                if pieces[0] == "dpwa":
                    other = pieces[1] if len(pieces) > 1 else "__init__"
                    if other != me:
                        found.setdefault((me, other), []).append(str(path.relative_to(ROOT)))
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {
        p.stem if p.is_file() else p.name
        for p in (ROOT / "dpwa").iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file()))
    }
    assert parts - set(RANK) == set(), "place the new part in RANK"


def test_no_import_points_up():
    upward = {
        f"{a} -> {b}": files
        for (a, b), files in imports().items()
        if RANK[b] > RANK[a] or (RANK[b] == RANK[a] and RANK[a] != TOOLS)
    }
    assert upward == {}
