"""The package trees of docs/design.md, made from the code: each module's first docstring line, in layer order.

tests/test_docs.py checks that the trees in docs/design.md are these; to write them there after a change:

    DPWA_WRITE_TREES=1 .venv/bin/python -m pytest -q tests/test_docs.py -k package_trees
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

from test_layers import GOSSIP_RANK, LAB_RANK, RANK

WIDTH, COLUMN = 120, 32
NOTES = {  # files that are not Python, and folders that are not packages
    "py.typed": "the PEP 561 marker: the package's annotations are for type checkers",
    "dashboard.html": "the dashboard's page: its script and its drawings in one file",
    "data": "files shipped in the package (data/README.md says where each comes from)",
}
ORDER = {"dpwa": RANK, "dpwa_lab": LAB_RANK, "gossip": {k or "*": v for k, v in GOSSIP_RANK.items()}}


ROLE = re.compile(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`")


def first_line(path: Path) -> str:
    """The module docstring's first paragraph, as plain text (no reST roles or literals), without its period."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return ROLE.sub(r"\1", " ".join(doc.split("\n\n")[0].split())).replace("``", "").removesuffix(".")


def entry(depth: int, name: str, text: str) -> list[str]:
    head = ("  " * depth + name).ljust(COLUMN)
    if len(head) > COLUMN:
        head += " "
    return textwrap.wrap(text, WIDTH, initial_indent=head, subsequent_indent=" " * COLUMN, break_on_hyphens=False)


def children(folder: Path) -> list[Path]:
    found = [
        p
        for p in folder.iterdir()
        if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py" or p.name in NOTES) and p.name != "__init__.py"
    ]
    ranks = ORDER.get(folder.name, {})

    def key(p: Path) -> tuple:
        stem = p.stem if p.is_file() else p.name
        default = ranks.get("*", 99) if p.is_file() else 99
        first = 0 if stem == "__main__" else 1
        return (first, ranks.get(stem, default), p.is_dir() and folder.name != "gossip", p.suffix != ".py", p.name)

    return sorted(found, key=key)


def tree(folder: Path, depth: int = 0, label: str | None = None) -> list[str]:
    init = folder / "__init__.py"
    lines = entry(
        depth, (label or folder.name) + "/", first_line(init) if init.exists() else NOTES.get(folder.name, "")
    )
    if not init.exists():
        return lines
    for child in children(folder):
        if child.is_dir():
            lines += tree(child, depth + 1)
        else:
            text = first_line(child) if child.suffix == ".py" else NOTES[child.name]
            lines += entry(depth + 1, child.name, text)
    return lines


def trees(root: Path) -> dict[str, str]:
    """The first line of each tree -> the tree."""
    made = ["\n".join(tree(root / "dpwa")), "\n".join(tree(root / "lab" / "dpwa_lab", label="lab/dpwa_lab"))]
    return {text.split("\n", 1)[0]: text for text in made}
