"""python -m dpwa.compare, dpwa.bench and dpwa.sim: launchers of the lab's commands (dpwa/labcommand.py).

With the lab, the launcher runs the lab's module as __main__ with the command line it was given; without it, it
exits 2 with one line that names the command and the install command. tests/test_install.py checks the same from
installed wheels.
"""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

import pytest

from dpwa import labcommand


def test_without_the_lab_one_line_says_what_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "dpwa_lab" else real(name, *a))
    ran = []
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: ran.append(a))
    with pytest.raises(SystemExit) as exited:
        labcommand.run_lab("dpwa_lab.bench", "python -m dpwa.bench")
    assert exited.value.code == 2 and ran == []
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "python -m dpwa.bench: the lab (package dpwa_lab, distribution dpwa-lab) is not installed; "
        "from a dpwa checkout: pip install -e . -e lab"
    ]


def test_with_the_lab_its_module_runs_as_main(monkeypatch):
    ran = []
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: ran.append((a, k)))
    labcommand.run_lab("dpwa_lab.sim", "python -m dpwa.sim")
    assert ran == [(("dpwa_lab.sim",), {"run_name": "__main__", "alter_sys": True})]


@pytest.mark.parametrize("name", ["compare", "bench", "sim"])
def test_each_launcher_names_its_lab_module_and_imports_no_lab(name):
    source = (Path(labcommand.__file__).parent / f"{name}.py").read_text()
    assert f'run_lab("dpwa_lab.{name}", "python -m dpwa.{name}")' in source
    assert "import dpwa_lab" not in source and "from dpwa_lab" not in source
