"""The documentation's links: every relative link in README.md and docs/ resolves, anchors included.

Anchors are computed from headings as GitHub computes them: the heading's text
(code spans, emphasis and link targets removed), lowercased, every character
that is not a letter, a digit, a space, '-' or '_' dropped, spaces turned into
'-', and '-1', '-2', ... appended to repeated headings.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 260

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def documents() -> list[Path]:
    """The Markdown files whose links are checked: the README, docs/, and the examples', the library's and the
    lab's READMEs (the embedded data's)."""
    files = [README, *sorted(DOCS.glob("*.md")), *sorted(ROOT.glob("examples/*/README.md"))]
    files += sorted((ROOT / "dpwa").glob("**/README.md")) + sorted((ROOT / "lab").glob("**/README.md"))
    return files


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_, not snake_case
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link into `path` may name."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in `path`'s prose, code spans left out."""
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub("", line)
        out += [(number, m.group(2)) for m in _INLINE_LINK.finditer(line)]
        out += [(number, m.group(1)) for m in _REFERENCE_DEF.finditer(line)]
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with `path`'s relative links, one line per broken link; empty when all resolve."""
    problems = []
    where = path.relative_to(root)
    for number, target in links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{where}:{number}: {target!r}: no file {resolved}")
            continue
        if anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
            problems.append(f"{where}:{number}: {target!r}: no heading with the anchor #{anchor} in {resolved.name}")
        elif anchor and resolved.suffix != ".md":
            problems.append(f"{where}:{number}: {target!r}: an anchor into a file that is not Markdown")
    return problems


def test_the_anchor_rule_matches_githubs():
    assert slug("Mixing modes") == "mixing-modes"
    assert slug("The symmetric exchange, step by step") == "the-symmetric-exchange-step-by-step"
    assert slug("Run the example: `./run.sh`") == "run-the-example-runsh"
    assert slug("Measured here (a shared box with 2 CPU cores)") == "measured-here-a-shared-box-with-2-cpu-cores"
    assert slug("Mode symmetric: exchanges refused `busy`") == "mode-symmetric-exchanges-refused-busy"
    assert slug("The `timeout_ms` key") == "the-timeout_ms-key"


def test_the_checker_finds_a_broken_file_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [ok too](other.md#a-section-1) [self](#page)\n"
        "[gone](missing.md) [no anchor](other.md#nowhere) [web](https://example.com/x#y)\n"
        "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)`\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 2, problems
    assert "missing.md" in problems[0] and "#nowhere" in problems[1]


def repeated_headings(text: str) -> list[str]:
    """Headings whose anchor another heading of the same page already has (outside code blocks)."""
    seen: set[str] = set()
    repeated = []
    for number, line in prose_lines(text):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            if base in seen:
                repeated.append(f"line {number}: {line.strip()}")
            seen.add(base)
    return repeated


def test_the_heading_check_finds_a_section_pasted_twice():
    page = "# Page\n\n## Threat model\n\ntext\n\n```bash\n# Threat model (a comment)\n```\n\n## Threat model\n"
    assert repeated_headings(page) == ["line 11: ## Threat model"]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_heading_is_once_in_its_page(path):
    """A section pasted twice (a merge, say) is a second copy that goes stale: docs/security.md held its whole
    threat model twice, the second copy outdated (issue 46). Every heading's anchor is unique in its page."""
    assert repeated_headings(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert links(path) or path != README, "the README links nowhere: the checker reads nothing"
    assert broken_links(path) == []


def test_the_readme_is_a_landing_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_readme_links_every_docs_file():
    targets = {target.partition("#")[0] for _, target in links(README)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in targets]
    assert missing == [], f"README.md's Documentation list does not link {missing}"


def test_the_readmes_three_node_config_is_the_sample():
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert blocks, "README.md shows no YAML config"
    sample = yaml.safe_load((ROOT / "samples" / "local-3.yaml").read_text(encoding="utf-8"))
    assert yaml.safe_load(blocks[0]) == sample
    assert [node["name"] for node in sample["nodes"]] == ["w1", "w2", "w3"]


def test_the_configuration_page_has_the_key_table_the_code_declares():
    """Every key is declared once (a field of dpwa.config.Config with its check and help); the page's table is
    made from it. After changing a key: python -c "from dpwa.config import key_table; print(key_table())"."""
    from dpwa.config import key_table, settings

    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert key_table() in page
    assert all(f"| `{name}` |" in page for name, _ in settings())


def test_the_package_trees_in_the_design_doc_are_the_codes():
    """docs/design.md's trees of dpwa/ and lab/dpwa_lab/ are made from the code (tests/helpers/tree.py: each
    module's first docstring paragraph, in layer order), so a module added, moved or renamed fails here until
    the doc says so. DPWA_WRITE_TREES=1 writes them."""
    import os

    from helpers.tree import trees

    design = ROOT / "docs" / "design.md"
    text = design.read_text()
    blocks = re.findall(r"```\n((?:dpwa/|lab/dpwa_lab/) .*?)\n```", text, re.S)
    made = trees(ROOT)
    assert sorted(b.split("\n", 1)[0] for b in blocks) == sorted(made), "a tree is missing from docs/design.md"
    if os.environ.get("DPWA_WRITE_TREES"):
        for block in blocks:
            text = text.replace(block, made[block.split("\n", 1)[0]])
        design.write_text(text)
        blocks = re.findall(r"```\n((?:dpwa/|lab/dpwa_lab/) .*?)\n```", text, re.S)
    for block in blocks:
        expected = made[block.split("\n", 1)[0]]
        assert block == expected, (
            "docs/design.md's package tree is not the code's: DPWA_WRITE_TREES=1 .venv/bin/python -m pytest -q "
            "tests/test_docs.py -k package_trees writes it\n"
            + "\n".join(
                difflib.unified_diff(
                    block.splitlines(), expected.splitlines(), "docs/design.md", "the code", lineterm="", n=0
                )
            )
        )
