"""The lab's commands under the library's names: ``python -m dpwa.compare``, ``dpwa.bench`` and ``dpwa.sim``.

The lab (the comparison, the benchmark, the simulator, the other training systems) is a distribution of its own,
``dpwa-lab`` (the package ``dpwa_lab``, in the repository's ``lab/`` folder), so that ``pip install dpwa`` installs
none of it. The library never imports the lab: these launchers look it up by name when a command starts and run
its module as ``__main__``, or say in one line what to install.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys

__all__ = ["LAB_PACKAGE", "INSTALL_LAB", "run_lab"]

LAB_PACKAGE = "dpwa_lab"
# from a checkout of the repository: the library and the lab, both editable (scripts/ensure-venv.sh does the same)
INSTALL_LAB = "pip install -e . -e lab"


def run_lab(module: str, command: str) -> None:
    """Run the lab's `module` (``dpwa_lab.compare``) as ``__main__`` for `command` (``python -m dpwa.compare``);
    without the lab, exit 2 with one line on stderr that says what to install."""
    if importlib.util.find_spec(LAB_PACKAGE) is None:
        print(
            f"{command}: the lab (package {LAB_PACKAGE}, distribution dpwa-lab) is not installed; "
            f"from a dpwa checkout: {INSTALL_LAB}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
