"""Every dpwa module, class or function the code's docstrings and the docs name exists.

Two kinds of reference are checked: a Sphinx role in a docstring or comment
(``:mod:`dpwa.gossip.node```, ``:class:`~dpwa.Node```), and any ``dpwa.x.y`` in
the Python files and the Markdown whose ``x`` is one of the package's own parts
(``dpwa.mixing.codecs.topk``) or a module that used to exist at the top
(``dpwa.node``, ``dpwa.kernels``, ...): each must import, attribute by attribute.
Logger names (``dpwa.dashboard``) and variables that happen to be called
``dpwa`` are left alone by the second rule, since their ``x`` is neither.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import dpwa

ROOT = Path(__file__).resolve().parent.parent
ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`~?(dpwa(?:\.\w+)+)`")
NAME = re.compile(r"(?<![\w/.$-])(dpwa(?:\.[A-Za-z_]\w*)+)")
FORMER = {"node", "kernels", "messages", "monitor", "processes", "peers", "launch", "mirror", "blends", "rules"}


def files() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("dpwa", "tests", "examples"):
        found += sorted(p for p in (ROOT / folder).rglob("*.py") if p.name != "test_names.py")
    found += sorted((ROOT / "examples").rglob("*.md"))
    return found


def resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def parts() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(dpwa.__path__)} | set(dpwa.__all__)


def references() -> dict[str, list[str]]:
    """name -> the places (file:line) that name it, for every reference either rule checks."""
    own = parts() | FORMER
    found: dict[str, list[str]] = {}
    for path in files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            names = set(ROLE.findall(line))
            names |= {n.rstrip(".") for n in NAME.findall(line) if n.split(".")[1] in own}
            for name in names:
                found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


@pytest.mark.io
def test_every_dpwa_name_the_code_and_docs_give_exists():
    missing = {name: places[:3] for name, places in sorted(references().items()) if not resolves(name)}
    assert missing == {}, "names that do not exist (rename them to the module that holds them now)"


def test_the_check_finds_what_it_should():
    """The rules catch a stale top-level module and a stale submodule, and pass live ones."""
    assert not resolves("dpwa.monitor") and not resolves("dpwa.mixing.mirror")
    assert resolves("dpwa.mixing.codecs.topk.TopK") and resolves("dpwa.Node")
    assert "dpwa.mixing.codecs" in references()
