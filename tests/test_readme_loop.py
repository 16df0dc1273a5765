"""README.md's training loop runs as it is shown: two processes, two nodes of one config, and both average.

The block after ``<!-- readme-loop -->`` in README.md is written to a file
unchanged, with one line appended that prints what the test checks, and run
by two processes, each told its node by ``$DPWA_CONFIG`` and ``$DPWA_NAME`` as
the README says. docs/api.md shows the same block. Each process is killed by
its PID if it has not ended in time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CHECKOUT_PATH, ROOT, make_config

MARK = re.compile(r"<!-- readme-loop -->\n```python\n(.*?)```", flags=re.DOTALL)
RUN_S = 90  # both processes, start to exit: imports of torch on 2 shared cores, then about a second of training
RESULT = (
    '\nimport json\nprint("readme-result " + json.dumps({"name": conn.name, "rank": conn.rank, '
    '"world_size": conn.world_size, "averaged": conn.averaged, "loss": loss.item(), '
    '"state": conn.stats()["state"]}), flush=True)\n'
)


def readme_loop(path: Path = ROOT / "README.md") -> str:
    found = MARK.findall(path.read_text(encoding="utf-8"))
    assert len(found) == 1, f"{path.name} shows {len(found)} readme-loop blocks; expected one"
    return found[0]


def test_the_api_page_shows_the_readmes_loop():
    assert readme_loop(ROOT / "docs" / "api.md") == readme_loop()


@pytest.mark.timeout(RUN_S + 30)
@pytest.mark.io
def test_the_readme_loop_runs_as_two_nodes_that_average(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(readme_loop() + RESULT)
    config = make_config(2)
    del config["join"]  # the library's default, join: auto: at a fresh start the nodes start together
    (tmp_path / "cluster.yaml").write_text(json.dumps(config))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPWA_", "TORCHELASTIC_"))}
    env.update(
        PYTHONPATH=CHECKOUT_PATH, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", DPWA_CONFIG=str(tmp_path / "cluster.yaml")
    )
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name in ("w0", "w1"):
            procs[name] = subprocess.Popen(
                [sys.executable, str(script)],
                env={**env, "DPWA_NAME": name},
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        deadline = time.monotonic() + RUN_S
        outputs = {
            name: proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for name, proc in procs.items()
        }
    except subprocess.TimeoutExpired:
        pytest.fail(f"the README's loop ran past {RUN_S} s")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name][-3000:]}"
        lines = [line for line in outputs[name].splitlines() if line.startswith("readme-result ")]
        assert lines, outputs[name][-3000:]
        result = json.loads(lines[-1].removeprefix("readme-result "))
        assert (result["name"], result["rank"], result["world_size"]) == (name, int(name[1]), 2)
        assert result["averaged"] > 0, outputs
        assert result["state"] == "closed"
        assert f"{name}: loss " in outputs[name]  # the README's own last line ran
