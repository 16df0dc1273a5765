"""The package's layers point only down: no module imports from a layer above its own.

The library (dpwa/): wire, runfiles < mixing < config < gossip < adapters < integrations, cluster < tools (cli,
and the launchers of the lab's commands: compare, bench, sim), over a base of logging and counters that every
layer may use. The lab (lab/dpwa_lab/, a distribution of its own) sits above the whole library: it may import any
of it, and no library module imports the lab. Within the lab, systems < the tools (workloads, compare, bench,
sim). A module that is not in its table fails the test, so a new one is placed on purpose.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

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
    "labcommand": 6,  # runs a lab module by name (runpy), or says what to install; imports no lab module
    "compare": 7,
    "bench": 7,
    "sim": 7,  # python -m dpwa.compare, dpwa.bench, dpwa.sim: launchers of the lab's commands
    "cli": 7,  # tools
    "__main__": 8,
    "__init__": 8,
}
TOOLS = 7
LAB_RANK = {  # lab/dpwa_lab/: its own layers, all above the library's
    "systems": 1,  # the other training systems over the library's transport
    "workloads": 2,
    "compare": 2,
    "bench": 2,
    "sim": 2,  # the lab's tools
    "__init__": 3,
}
LAB_TOOLS = 2
LIBRARY, LAB = "dpwa", "dpwa_lab"


def imports(package: Path) -> dict[tuple[str, str], list[str]]:
    """(importer's part, imported top-level package and part) -> the files where that import is made, for every
    module of `package` (dpwa/ or lab/dpwa_lab/). A part is the first name under the top-level package."""
    found: dict[tuple[str, str], list[str]] = {}
    top = package.name
    for path in package.rglob("*.py"):
        parts = (top, *path.relative_to(package).with_suffix("").parts)
        me = parts[1] if len(parts) > 1 else "__init__"
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = list(parts[:-1])[: len(parts) - 1 - (node.level - 1)]
                    names = [".".join(base + ([node.module] if node.module else []))]
                else:
                    names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                pieces = name.split(".")
                if pieces[0] in (LIBRARY, LAB):
                    other = f"{pieces[0]}.{pieces[1] if len(pieces) > 1 else '__init__'}"
                    if other != f"{top}.{me}":
                        found.setdefault((me, other), []).append(str(path.relative_to(ROOT)))
    return found


def parts_of(package: Path) -> set[str]:
    return {
        p.stem if p.is_file() else p.name
        for p in package.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").is_file()))
    }


def test_every_part_of_the_library_and_the_lab_has_a_layer():
    assert parts_of(ROOT / LIBRARY) - set(RANK) == set(), "place the new part of dpwa/ in RANK"
    assert parts_of(ROOT / "lab" / LAB) - set(LAB_RANK) == set(), "place the new part of lab/dpwa_lab/ in LAB_RANK"
    assert not (ROOT / LIBRARY / "lab").exists(), "the lab is lab/dpwa_lab/, a distribution of its own"


def test_no_import_in_the_library_points_up_and_none_reaches_the_lab():
    found = imports(ROOT / LIBRARY)
    into_the_lab = {f"{a} -> {b}": files for (a, b), files in found.items() if b.startswith(f"{LAB}.")}
    assert into_the_lab == {}, "the library never imports the lab (dpwa/labcommand.py runs it by name)"
    upward = {
        f"{a} -> {b}": files
        for (a, b), files in found.items()
        if (other := RANK[b.split(".")[1]]) > RANK[a] or (other == RANK[a] and RANK[a] != TOOLS)
    }
    assert upward == {}


def test_no_import_in_the_lab_points_up():
    found = imports(ROOT / "lab" / LAB)
    library = {b for (_, b) in found if b.startswith(f"{LIBRARY}.")}
    assert library, "the lab imports the library (found no import of dpwa: is the scan looking at the lab?)"
    assert all(b.split(".")[1] in RANK for b in library), sorted(library)
    upward = {
        f"{a} -> {b}": files
        for (a, b), files in found.items()
        if b.startswith(f"{LAB}.")
        and ((other := LAB_RANK[b.split(".")[1]]) > LAB_RANK[a] or (other == LAB_RANK[a] and LAB_RANK[a] != LAB_TOOLS))
    }
    assert upward == {}


def test_the_lab_is_a_distribution_of_its_own_that_depends_on_this_library_at_its_version():
    """The lab imports more than the library's public surface, so it pins the library's version; both wheels
    come from this repository (tests/test_install.py builds them)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    library = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lab = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())
    version = library["project"]["version"]
    assert lab["project"]["name"] == "dpwa-lab" and lab["project"]["version"] == version, lab["project"]
    assert f"dpwa=={version}" in lab["project"]["dependencies"], lab["project"]["dependencies"]
    assert library["tool"]["setuptools"]["packages"]["find"]["include"] == [LIBRARY, f"{LIBRARY}.*"]
    assert lab["tool"]["setuptools"]["packages"]["find"]["include"] == [LAB, f"{LAB}.*"]


def test_the_lab_finds_the_checkout_and_the_packages_from_its_place():
    """What the lab derives from its own location, from a checkout: where the example keeps CIFAR-10 (the
    comparison's default --data-dir), and the folders its child processes import dpwa_lab and dpwa from."""
    from dpwa_lab.compare.spawning import IMPORT_ROOTS, child_pythonpath
    from dpwa_lab.compare.workload import CHECKOUT_CIFAR_DIR

    assert CHECKOUT_CIFAR_DIR == ROOT / "examples" / "pytorch-cifar" / "data" / "cifar-10-batches-py"
    assert (str(ROOT / "lab"), str(ROOT)) == IMPORT_ROOTS
    assert child_pythonpath().split(os.pathsep)[:2] == [str(ROOT / "lab"), str(ROOT)]


# --------------------------------------------------------------------------- the gossip node's own layers

GOSSIP_RANK = {  # dpwa/gossip/: who the members are and whom to ask < moving snapshots < exchanging < the node
    "membership": 1,  # the view (pure), its threaded owner, refresh, rendezvous, barriers, flow control, relays
    "transfer": 2,  # the node's message kinds, snapshots, serving and requesting them, validation, joins
    "exchange": 3,  # the exchange's machine (pure) and its driver, the two mixing modes, the rule's guard
    "": 4,  # the node that assembles them: node, its services, start, setup, settings, reporting
}
SIBLINGS_MAX = 8  # no module imports more of the modules (or sub-packages) beside it


def gossip_imports() -> list[tuple[str, str, str]]:
    """(importing module, its sub-package or "", imported module) for every import of a dpwa.gossip module by
    another (TYPE_CHECKING imports included: a type named from above is a dependency too)."""
    found = []
    base = ROOT / LIBRARY / "gossip"
    for path in base.rglob("*.py"):
        rel = path.relative_to(base).with_suffix("").parts
        module = ".".join(("dpwa", "gossip", *rel))
        package = module.split(".") if rel[-1] == "__init__" else module.split(".")[:-1]
        if rel[-1] == "__init__":
            package = package[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                    names = [".".join(target)] if node.module else [".".join(target + [a.name]) for a in node.names]
                else:
                    names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("dpwa.gossip.") and name != module:
                    found.append((module, rel[0] if len(rel) > 1 else "", name))
    return found


def sub_package(module: str) -> str:
    parts = module.split(".")[2:]
    return parts[0] if len(parts) > 1 and parts[0] in GOSSIP_RANK else ""


def test_the_gossip_sub_packages_have_a_layer_and_point_only_down():
    base = ROOT / LIBRARY / "gossip"
    subs = {p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert subs == set(GOSSIP_RANK) - {""}, "place the new sub-package of dpwa/gossip in GOSSIP_RANK"
    upward = sorted(
        f"{module} -> {name}"
        for module, sub, name in gossip_imports()
        if GOSSIP_RANK[sub_package(name)] > GOSSIP_RANK[sub] and not module.endswith("__init__")
    )
    assert not upward, "gossip imports that point up (membership < transfer < exchange < the node):\n" + "\n".join(
        upward
    )


def test_no_gossip_module_imports_more_than_eight_of_its_siblings():
    siblings: dict[str, set[str]] = {}
    for module, _, name in gossip_imports():
        package = module.rsplit(".", 1)[0]
        if name.startswith(package + "."):
            rest = name[len(package) + 1 :].split(".")
            siblings.setdefault(module, set()).add(rest[0])
    crowded = {m: sorted(s) for m, s in siblings.items() if len(s) > SIBLINGS_MAX}
    assert not crowded, f"modules that import more than {SIBLINGS_MAX} of their siblings: {crowded}"
