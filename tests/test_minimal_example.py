"""examples/minimal.py: a complete script of at most 60 lines, trained under torchrun as two workers.

The torchrun agent runs in its own session, and so does each of its workers
(torchrun starts them so): after the run, or on failure, each worker still
alive is killed by its PID, then the agent's group.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CHECKOUT_PATH, ROOT
from helpers.proc_tree import child_pids

SCRIPT = ROOT / "examples" / "minimal.py"
MAX_LINES = 60
RUN_S = 90  # torchrun, start to exit: about 15 s here, mostly imports of torch
_BIN = Path(sys.executable).parent / "torchrun"  # .venv/bin/torchrun
TORCHRUN = [str(_BIN)] if _BIN.exists() else [sys.executable, "-m", "torch.distributed.run"]


def stop(proc: subprocess.Popen) -> None:
    """Kill torchrun's workers, each by its PID (each is in its own session), then the agent's group."""
    if proc.poll() is not None:
        return
    for worker in child_pids(proc.pid):
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(20)


def test_the_minimal_example_is_at_most_60_lines():
    lines = SCRIPT.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"examples/minimal.py has {len(lines)} lines"


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 30)
def test_the_minimal_example_trains_under_torchrun_and_both_ranks_average(tmp_path):
    """torchrun --standalone --nproc-per-node 2 examples/minimal.py, with no dpwa variable set (issue 42: it
    needed DPWA_CONFIG=samples/torchrun.yaml, and exited 1 without): the torchrun defaults apply; ranks 0 and 1
    (names rank0, rank1) each trained their shard, averaged with the other, and their loss fell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPWA_")}
    env.update(PYTHONPATH=CHECKOUT_PATH, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    log = tmp_path / "torchrun.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(SCRIPT)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )
    try:
        code = proc.wait(RUN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"examples/minimal.py under torchrun ran past {RUN_S} s:\n{log.read_text()[-3000:]}")
    finally:
        stop(proc)
    text = log.read_text()
    assert code == 0, text[-3000:]
    results = {}
    decoder = json.JSONDecoder()
    for match in re.finditer("minimal-result ", text):  # torchrun may prefix a worker's lines
        result, _ = decoder.raw_decode(text, match.end())
        results[result["name"]] = result
    assert sorted(results) == ["rank0", "rank1"], text[-3000:]
    for name, result in results.items():
        assert (result["rank"], result["world_size"]) == (int(name[-1]), 2), result
        assert result["averaged"] > 0, result
        assert result["last_loss"] < 0.5 * result["first_loss"], result
        assert result["accuracy"] > 0.8, result
    print(f"torchrun of examples/minimal.py: {time.monotonic() - started:.1f} s; {results}")
