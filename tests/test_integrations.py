"""The Lightning and Hugging Face integrations (dpwa.integrations): each example trained under torchrun.

The slow tests run ``torchrun --standalone --nproc-per-node 2`` of
examples/integrations/lightning_tiny.py and hf_tiny.py, each worker writing
its result to OUT/<name>.json, and check that both workers averaged with the
other, that their loss fell, and that neither framework ran DDP (no process
group, one process per Trainer). They are skipped only when the extra is not
installed (CI installs both from requirements.txt).

The torchrun agent runs in its own session; its workers each run in theirs
(torchrun starts them so), so on failure each worker is killed by its PID,
then the agent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import CHECKOUT_PATH, ROOT, free_port, make_config
from helpers.proc_tree import child_pids

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # .venv/bin/torchrun
DPWA_RUN = [sys.executable, "-m", "dpwa", "run", "--nodes", "2"]  # ./run.sh --nodes 2 -- python SCRIPT
AVERAGED_MIN = 0.95  # of its exchange steps, each worker averages at least this share with the defaults (issue 48)
EXAMPLES = ROOT / "examples" / "integrations"
RUN_S = 150  # one example's torchrun, start to exit: about 40 s on 2 shared cores


class Torchrun:
    """One torchrun agent started by a test; stopped with its workers, each by its PID."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, argv: list[str], log: Path, launcher: list[str] = TORCHRUN) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("DPWA_CONFIG", "DPWA_NAME")}
        env.update(PYTHONPATH=CHECKOUT_PATH, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                launcher + argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        return self.proc

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for worker in child_pids(proc.pid):  # each in its own session: killing the agent's group misses them
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(20)


@pytest.fixture
def torchrun():
    made = Torchrun()
    yield made
    made.stop()


def need(*modules: str) -> None:
    """Skip unless the extra's packages are installed (found, not imported: importing lightning takes ~20 s here)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        extra = "lightning" if "lightning" in missing else "transformers"
        pytest.skip(f"{', '.join(missing)} not installed: pip install 'dpwa[{extra}]' (CI installs requirements.txt)")


def run_example(
    torchrun: Torchrun, tmp_path: Path, script: str, *args: str, launcher: str = "torchrun"
) -> tuple[dict[str, dict], float]:
    """The example on two workers, started by torchrun (--standalone --nproc-per-node 2: rank0, rank1) or by
    dpwa's launcher (python -m dpwa run --nodes 2, as ./run.sh: w1, w2); each worker's result by name, and the
    seconds."""
    out, log = tmp_path / ("out" if launcher == "torchrun" else "out-dpwa"), tmp_path / f"{launcher}.log"
    started = time.monotonic()
    script_argv = [str(EXAMPLES / script), "--out", str(out), *args]
    if launcher == "torchrun":
        proc = torchrun.start(["--standalone", "--nproc-per-node", "2", *script_argv], log)
    else:
        runs = ["--runs-dir", str(tmp_path / "runs"), "--"]
        proc = torchrun.start([*runs, sys.executable, *script_argv], log, launcher=DPWA_RUN)
    try:
        code = proc.wait(RUN_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{script} under {launcher} ran past {RUN_S} s:\n{log.read_text()[-3000:]}")
    assert code == 0, log.read_text()[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return results, time.monotonic() - started


def why(result: dict) -> str:
    """What a worker's counters say of the exchanges that did not average, as one string (pytest cuts a long dict
    short, in a tuple too)."""
    stats = result["stats"]
    said = ("fetches_", "refused.", "exchanges_decided.", "starts_skipped", "busy_answers", "publish_skipped", "joined")
    shown = {k: v for k, v in stats.items() if v and k.startswith(said) and k not in ("fetches_started", "fetches_ok")}
    started = stats.get("fetches_started")
    return json.dumps(
        {"exchange_steps": result["exchange_steps"], "started": started, "barriers": stats.get("barriers"), **shown}
    )


def check_training(results: dict[str, dict]) -> None:
    """Both workers trained, averaged with each other at AVERAGED_MIN of their steps or more, and their loss
    fell."""
    assert len(results) == 2, sorted(results)
    for name, result in results.items():
        other = next(n for n in results if n != name)
        peers = result["stats"]["peers"]
        assert result["averaged"] > 0 and peers[other]["averaged"] > 0, (name, result["stats"])
        # with the defaults: started together, and the one that finished first served the other's last steps
        assert result["averaged"] >= AVERAGED_MIN * result["exchange_steps"], (
            f"{name}: {result['averaged']} averaged; {why(result)}"
        )
        assert result["stats"]["state"] == "closed"
        losses = result["losses"]
        assert len(losses) >= 20, (name, losses)
        head, tail = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert tail < 0.75 * head, f"{name}: the loss did not fall: first five {losses[:5]}, last five {losses[-5:]}"
        assert result["distributed"] is False, result  # no torch.distributed process group: no DDP


# --------------------------------------------------------------------------- the examples under torchrun


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_S + 30)
def test_the_lightning_example_trains_one_copy_per_worker_and_they_average_under_torchrun_and_dpwas_launcher(
    torchrun, tmp_path
):
    """examples/integrations/lightning_tiny.py on two workers (3 epochs of the digits, a shard each), with
    gradient accumulation over 2 batches and bf16 autocast (issue 42), under torchrun --nproc-per-node 2 and
    then under python -m dpwa run --nodes 2 (./run.sh's launcher): each worker runs SingleDeviceStrategy
    (Trainer(devices=1)), no process group; it exchanges once per optimizer step (36), not per batch (72:
    before, it exchanged at every batch, moving the parameters between the batches whose gradients are
    summed); each averages with the other at 95% of its steps or more with the defaults (issue 48: before,
    31 of 144 under run.sh, 72 of 144 under torchrun), and their loss falls."""
    need("lightning")
    args = ("--epochs", "3", "--accumulate", "2", "--precision", "bf16-mixed")
    for launcher in ("torchrun", "dpwa"):
        results, seconds = run_example(torchrun, tmp_path, "lightning_tiny.py", *args, launcher=launcher)
        check_training(results)
        for result in results.values():
            assert result["strategy"] == "SingleDeviceStrategy" and result["precision"] == "bf16-mixed", result
            assert result["steps"] == 72 and result["optimizer_steps"] == result["exchange_steps"] == 36, result
            assert result["test_acc"] > 0.5, result
        print(f"lightning, {launcher}: {seconds:.1f} s; averaged {[results[n]['averaged'] for n in sorted(results)]}")


def checkpoint_sums(folder: Path) -> dict[str, float]:
    """A Trainer checkpoint's sums, as hf_tiny.py's AtStart computes them of what a worker trains from."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    optimizer = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    return {
        "weights": sum(float(t.double().sum()) for t in weights.values()),
        "optimizer": sum(float(s["exp_avg"].double().sum()) for s in optimizer["state"].values()),
    }


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_S + 30)
def test_the_hugging_face_example_trains_one_copy_per_worker_they_average_and_each_resumes_its_own_state(
    torchrun, tmp_path
):
    """torchrun --nproc-per-node 2 examples/integrations/hf_tiny.py (a two-layer GPT-2 from a config, 120
    optimizer steps of synthetic tokens, each accumulating 2 batches, in bf16 autocast): the callback, made
    before TrainingArguments, hides torchrun's variables, so each Trainer is one process (world size 1, not
    parallel, the model not wrapped in DDP); one exchange per optimizer step; both workers average with
    the other and their loss falls.

    The 120 steps run as 60 that save a checkpoint, then a resumed run to 120 (issue 48): each rank trains on
    from its own checkpoint's weights AND optimizer state. Before, every rank but 0 took rank 0's weights
    from a donor at the start while it kept its own optimizer state. Then 60 steps under python -m dpwa run
    --nodes 2 (./run.sh's launcher). Each run averages at 95% of its steps or more with the defaults: 60 steps
    (about a second of training each) allow three misses, where 30 allowed one and a CI run under load
    missed two."""
    need("transformers", "accelerate")
    args = ("--accumulate", "2", "--bf16")
    first, seconds = run_example(torchrun, tmp_path, "hf_tiny.py", "--steps", "60", "--save-steps", "60", *args)
    saved = {name: checkpoint_sums(tmp_path / "out" / "hf" / name / "checkpoint-60") for name in first}
    assert sorted(saved) == ["rank0", "rank1"]
    gap = abs(saved["rank0"]["weights"] - saved["rank1"]["weights"])
    assert gap > 1e-4, f"the ranks' checkpoints hold the same weights ({saved}): a donor's could not be told apart"
    results, more = run_example(torchrun, tmp_path, "hf_tiny.py", "--steps", "120", "--resume", *args)
    check_training(results)
    for name, result in results.items():
        start, own = result["at_start"], saved[name]
        assert start["step"] == 60, result["at_start"]
        assert start["weights"] == pytest.approx(own["weights"], rel=1e-9, abs=gap / 1000), (name, start, saved)
        assert start["optimizer"] == pytest.approx(own["optimizer"], rel=1e-9, abs=1e-9), (name, start, saved)
        assert result["world_size"] == 1 and result["parallel_mode"] == "ParallelMode.NOT_PARALLEL", result
        assert result["ddp"] is False and result["steps"] == 120 and result["exchange_steps"] == 60, result
        assert result["bf16"] is True, result
        # resumed with join: never, the ranks still start together: at the start barrier, as under dpwa's launcher
        assert result["stats"]["barriers"] == {"start": 1}, (name, result["stats"]["barriers"])
    print(f"transformers: {seconds:.1f} s + {more:.1f} s; averaged {[results[n]['averaged'] for n in sorted(results)]}")
    # and under dpwa's launcher (./run.sh's): the nodes start together at the start barrier, each on its shard
    results, seconds = run_example(torchrun, tmp_path, "hf_tiny.py", "--steps", "60", *args, launcher="dpwa")
    check_training(results)
    for result in results.values():
        assert result["world_size"] == 1 and result["ddp"] is False and result["exchange_steps"] == 60, result
    print(f"transformers, dpwa: {seconds:.1f} s; averaged {[results[n]['averaged'] for n in sorted(results)]}")


LIGHTNING_TWO_DEVICES = """
import sys, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from dpwa.integrations.lightning import DpwaCallback

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

gossip = DpwaCallback(config=sys.argv[1], name="w1")
data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=4, callbacks=[gossip], logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Tiny(), data)
print("trained with DDP and gossip")
"""


@pytest.mark.slow
@pytest.mark.timeout(RUN_S + 90)
def test_the_frameworks_own_launchers_run_one_copy_per_worker_or_are_refused_with_one_line(torchrun, tmp_path):
    """Issue 42, as their users start them, each with 2 processes: ``accelerate launch --multi_gpu
    --num_processes 2`` of the HF example (on a CPU machine, the command that starts two) trains one copy
    per worker with gossip, no DDP; Lightning's ``Trainer(devices=2)``, started with python (Lightning
    launches the second process itself), is refused in both processes at setup with the one line that says
    what to do, and never trains with DDP's all-reduce and gossip at once."""
    need("lightning", "transformers", "accelerate")
    out, log = tmp_path / "out", tmp_path / "accelerate.log"
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    accelerate += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    accelerate += ["--main_process_port", str(free_port())]
    proc = torchrun.start([str(EXAMPLES / "hf_tiny.py"), "--steps", "20", "--out", str(out)], log, accelerate)
    assert proc.wait(RUN_S) == 0, log.read_text()[-3000:]
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(results) == ["rank0", "rank1"], log.read_text()[-3000:]
    for result in results.values():
        assert result["world_size"] == 1 and result["ddp"] is False and result["distributed"] is False, result
        assert result["averaged"] > 0 and result["exchange_steps"] == 20, result

    config, script, log = tmp_path / "two.yaml", tmp_path / "two_devices.py", tmp_path / "lightning.log"
    config.write_text(json.dumps(make_config(2)))  # YAML reads JSON
    script.write_text(LIGHTNING_TWO_DEVICES)
    proc = torchrun.start([str(script), str(config)], log, [sys.executable])
    assert proc.wait(RUN_S) != 0
    text = log.read_text()
    refusal = "RuntimeError: dpwa: the Trainer's strategy (DDPStrategy) spans 2 processes and would all-reduce"
    assert text.count(refusal) == 2 and "trained with DDP and gossip" not in text, text[-3000:]
    assert "Give each process one device (Trainer(devices=1)" in text


GUARDS = """
import os, sys, types
from dpwa.integrations.transformers import DpwaTrainerCallback
from dpwa.integrations.lightning import DpwaCallback
from transformers import TrainingArguments

# as torchrun starts a worker: the callback, made first, takes torchrun's variables out of the environment
callback = DpwaTrainerCallback(config="examples/integrations/torchrun.yaml")
assert "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ and callback.node.rank == 1
assert callback.node_name == "rank1" and callback.node.torchrun["MASTER_PORT"] == "29999"
args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, report_to="none")
assert args.world_size == 1 and str(args.parallel_mode) == "ParallelMode.NOT_PARALLEL", args.parallel_mode

# a Trainer that is distributed all the same is refused before any adapter exists
for refuse in (
    lambda: callback.on_train_begin(types.SimpleNamespace(world_size=2, parallel_mode="distributed"), None, None),
    lambda: DpwaCallback(config="x.yaml").setup(types.SimpleNamespace(world_size=2, strategy=object()), None, "fit"),
):
    try:
        refuse()
    except RuntimeError as exc:
        assert "all-reduce" in str(exc), exc
    else:
        raise AssertionError("not refused")
assert callback.adapter is None

# a second train() or fit() with a callback whose node closed at the end of the first: refused, one line
hf = DpwaTrainerCallback(config="examples/integrations/torchrun.yaml")
pl = DpwaCallback(config="x.yaml")
fresh, resumed = types.SimpleNamespace(global_step=0), types.SimpleNamespace(global_step=5)
one = dict(world_size=1, strategy=object(), global_step=0)
for cb, second in (
    (hf, lambda: hf.on_train_begin(types.SimpleNamespace(world_size=1), fresh, None, model=object())),
    (pl, lambda: pl.on_fit_start(types.SimpleNamespace(ckpt_path=None, **one), object())),
):
    cb.session._closed = True  # as on_train_end / on_fit_end leave it
    try:
        second()
    except RuntimeError as exc:
        assert "make a new callback for another run" in str(exc), exc
    else:
        raise AssertionError("a second run was not refused")

# Lightning with accumulate_grad_batches=2: one exchange per optimizer step (global_step rises after batches 1
# and 3), the parameters untouched between the two batches of a step
class Recorder:
    pending = False
    def __init__(self):
        self.calls = []
    def send(self):
        self.pending = True
        self.calls.append("send")
    def wait(self, loss):
        self.pending = False
        self.calls.append("wait")
    def note_loss(self, loss):
        self.calls.append("loss")

acc = DpwaCallback(config="x.yaml")
acc.session = Recorder()
trainer = types.SimpleNamespace(global_step=0)
for batch in range(4):
    acc.on_train_batch_start(trainer, None, None, batch)
    trainer.global_step += batch % 2  # the optimizer steps after the second batch of each pair
    acc.on_train_batch_end(trainer, None, {"loss": 1.0}, None, batch)
assert acc.session.calls == ["send", "loss", "wait", "send", "loss", "wait"], acc.session.calls

# a run resumed from the worker's own checkpoint (HF: global_step > 0 at on_train_begin; Lightning: ckpt_path)
# starts its node with resumed=True (join: never): a donor's weights must not replace the restored ones
class Starts:
    def __init__(self):
        self.resumed = []
    def start(self, model, resumed=False):
        self.resumed.append(resumed)

hf, pl = DpwaTrainerCallback(config="examples/integrations/torchrun.yaml"), DpwaCallback(config="x.yaml")
hf.session, pl.session = Starts(), Starts()
args = types.SimpleNamespace(world_size=1)
hf.on_train_begin(args, fresh, None, model=object())
hf.on_train_begin(args, resumed, None, model=object())
pl.on_fit_start(types.SimpleNamespace(ckpt_path=None, **one), object())
pl.on_fit_start(types.SimpleNamespace(ckpt_path="last.ckpt", **one), object())
assert hf.session.resumed == [False, True] and pl.session.resumed == [False, True], (hf.session, pl.session)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_trainer_callback_hides_torchrun_from_the_trainer_and_both_refuse_a_distributed_trainer(tmp_path):
    """As a torchrun worker (RANK 1 of 2, LOCAL_RANK, MASTER_*): DpwaTrainerCallback, made before
    TrainingArguments, removes torchrun's variables, so TrainingArguments sees one process (world size
    1, not parallel); and both callbacks refuse a Trainer that spans several processes (RuntimeError
    naming the all-reduce), before making an adapter. Nothing is started: no store, no process group."""
    need("lightning", "transformers", "accelerate")
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH, HF_HUB_OFFLINE="1", RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    env.update(LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", GUARDS, str(tmp_path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=100
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# --------------------------------------------------------------------------- in one process


def test_node_from_env_takes_arguments_first_then_the_environment():
    from dpwa.config import ConfigError
    from dpwa.integrations.env import node_from_env

    env = {"DPWA_CONFIG": "env.yaml", "DPWA_NAME": "w2"}
    assert (node_from_env(environ=env).config, node_from_env(environ=env).name) == ("env.yaml", "w2")
    given = node_from_env(Path("given.yaml"), "w1", environ=env)
    assert (given.config, given.name, given.under_torchrun) == ("given.yaml", "w1", False)
    with pytest.raises(ConfigError, match="given.yaml"):  # its place in the node list is read from the config
        assert given.rank
    assert node_from_env({"nodes": "torchrun"}, environ={}).config == {"nodes": "torchrun"}
    with pytest.raises(ConfigError, match="DPWA_CONFIG"):
        node_from_env(environ={})


def test_rank_and_world_size_are_known_before_training_under_every_launcher(tmp_path):
    """Issue 48: under ./run.sh both nodes trained on all the data, silently: node.rank and node.world_size,
    documented "for sharding data", were torchrun's, and 0 and 1 elsewhere. Now they are the node's index in
    the config's list and the list's length under dpwa's launcher (w1: 0 of 2, w2: 1 of 2), torchrun's under
    torchrun, before any adapter exists; and the shards rank::world_size are disjoint."""
    from conftest import make_config
    from dpwa.integrations.env import node_from_env

    config = make_config(2)
    names = [node["name"] for node in config["nodes"]]
    placements = [(node_from_env(config, name, environ={}).rank, node_from_env(config, name, environ={}).world_size)
                  for name in names]  # fmt: skip
    assert placements == [(0, 2), (1, 2)]
    shards = [set(range(1500)[rank::world]) for rank, world in placements]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 1500
    # node.shard(data): the same shards, as Subsets a Trainer or a DataLoader takes
    data = list(range(1501))
    subsets = [node_from_env(config, name, environ={}).shard(data) for name in names]
    assert [len(s) for s in subsets] == [751, 750] and set(subsets[0]) | set(subsets[1]) == set(data)
    assert not set(subsets[0]) & set(subsets[1])
    ranks = [dict(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500") for r in (0, 1)]
    under_torchrun = [set(node_from_env(environ=env).shard(data)) for env in ranks]
    assert under_torchrun == [set(s) for s in subsets]
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert (node_from_env(environ=torchrun).rank, node_from_env(environ=torchrun).world_size) == (1, 4)
    assert (node_from_env(config, None, environ={}).rank, node_from_env(config, "nobody", environ={}).world_size) == (
        0,
        1,
    )


def test_under_torchrun_a_config_is_optional_and_the_defaults_are_the_sample_files():
    """Issue 42: `torchrun --nproc-per-node 2 examples/minimal.py` without DPWA_CONFIG exited 1 on both ranks.
    A torchrun worker given no config takes the torchrun defaults, which are samples/torchrun.yaml's keys
    (kept the same by this test); outside torchrun no config is still an error naming both ways to give one."""
    import yaml

    from dpwa.adapters.hook import TORCHRUN_DEFAULTS
    from dpwa.config import ConfigError, parse_config
    from dpwa.integrations.env import node_from_env

    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    node = node_from_env(environ=torchrun)
    assert node.config == dict(TORCHRUN_DEFAULTS) and node.name is None and node.under_torchrun
    assert node_from_env(environ={"TORCHELASTIC_RUN_ID": "x"}).config == dict(TORCHRUN_DEFAULTS)
    assert node_from_env(environ={**torchrun, "DPWA_CONFIG": "mine.yaml"}).config == "mine.yaml"  # given wins
    sample = yaml.safe_load((ROOT / "samples" / "torchrun.yaml").read_text())
    assert sample == dict(TORCHRUN_DEFAULTS)
    assert parse_config(dict(TORCHRUN_DEFAULTS)).nodes == parse_config(sample).nodes
    with pytest.raises(ConfigError, match="pass config=FILE, or set DPWA_CONFIG=FILE .under torchrun, none"):
        node_from_env(environ={"RANK": "0"})  # not a torchrun worker: RANK alone says nothing


def test_under_torchrun_the_name_is_left_to_the_adapter_and_hidden_variables_come_back_only_for_the_start():
    from dpwa.integrations.env import hide_torchrun, node_from_env

    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env.update(TORCHELASTIC_RUN_ID="r", OTHER="kept")
    node = node_from_env("c.yaml", environ=env)
    assert node.name is None and node.under_torchrun and (node.rank, node.world_size, node.local_rank) == (1, 2, 1)
    hidden = hide_torchrun(env)
    assert set(hidden) == {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    assert env == {"TORCHELASTIC_RUN_ID": "r", "OTHER": "kept"}
    with node.torchrun_environment(env):
        assert env["RANK"] == "1" and env["MASTER_PORT"] == "29500"
    assert env == {"TORCHELASTIC_RUN_ID": "r", "OTHER": "kept"}


def test_a_node_waits_at_the_start_barrier_under_dpwas_launcher_and_resumed_under_torchrun(monkeypatch):
    """Under dpwa's launcher every node waits for its peers before its first step; under torchrun only a
    resumed one (join: never lines nothing up); started by hand, none."""
    from dpwa.integrations.env import NodeEnv
    from dpwa.runfiles.metrics import RUN_DIR_ENV

    torchrun = {"RANK": "0", "WORLD_SIZE": "2"}
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    assert not NodeEnv("c.yaml", "w1").waits_at_start() and not NodeEnv("c.yaml", "w1").waits_at_start(True)
    assert not NodeEnv("c.yaml", None, torchrun).waits_at_start() and NodeEnv("c.yaml", None, torchrun).waits_at_start(
        True
    )
    monkeypatch.setenv(RUN_DIR_ENV, "/tmp/run")
    assert NodeEnv("c.yaml", "w1").waits_at_start() and NodeEnv("c.yaml", "w1").waits_at_start(True)
    assert not NodeEnv("c.yaml", None, torchrun).waits_at_start()  # a fresh torchrun start joins rank 0


def test_losses_are_read_from_numbers_tensors_and_lightning_outputs():
    import torch

    from dpwa.integrations.session import loss_of

    assert loss_of(torch.tensor(1.5)) == 1.5 and loss_of({"loss": torch.tensor(2.0)}) == 2.0 and loss_of(3) == 3.0
    assert loss_of(None) is None and loss_of({"acc": 1}) is None and loss_of(float("nan")) is None
    assert loss_of(torch.ones(3)) is None and loss_of("x") is None


@pytest.mark.io
@pytest.mark.timeout(60)
def test_a_worker_that_resumes_from_its_own_checkpoint_keeps_its_weights(nodes, steppers):
    """Issue 48: a torchrun resume replaced rank 1's restored weights with rank 0's (join: auto), while rank 1
    kept its own optimizer state. A callback that sees a resumed run starts its node with resumed_config
    (join: never): w1 keeps its 7s next to a w0 at 2; the same config unresumed takes w0's 2s."""
    from conftest import make_config
    from dpwa import NumpyParams
    from dpwa.integrations.session import resumed_config

    cfg = make_config(2, join="auto")
    w0 = nodes(cfg, "w0", NumpyParams(np.full(8, 2.0, np.float32)))
    steppers.start(w0)  # a donor serves joiners between its steps
    restored = np.full(8, 7.0, np.float32)
    w1 = nodes(resumed_config(cfg), "w1", NumpyParams(restored))
    assert w1.joined is None and np.all(restored == 7.0) and w1.config.join == "never"
    w1.close()
    fresh = np.full(8, 7.0, np.float32)
    again = nodes(cfg, "w1", NumpyParams(fresh))  # the control: join auto takes the donor's state
    assert again.joined is not None and again.joined.donor == "w0" and np.all(fresh == 2.0), again.joined


def test_the_session_pairs_every_wait_with_a_send_and_closes_once():
    from dpwa.integrations.env import NodeEnv
    from dpwa.integrations.session import AdapterSession

    calls: list[tuple] = []

    class FakeAdapter:
        def update_send(self, loss, batch_size):
            calls.append(("send", loss))
            return True

        def update_wait(self, loss):
            calls.append(("wait", loss))

        def linger(self, idle_s, limit_s):
            calls.append(("linger", limit_s))

        def close(self):
            calls.append(("close",))

        def stats(self):
            return {"state": "closed"}

    session = AdapterSession(NodeEnv("c.yaml", "w1"), {}, linger_s=2.0)
    assert session.send() is False and session.wait(1.0) is None and session.stats() == {}  # not started: no calls
    session.adapter = FakeAdapter()  # type: ignore[assignment]
    session.send()
    session.wait({"loss": 0.5})
    session.wait(0.4)  # no send open: not passed on, but remembered
    session.send()
    session.send()  # the open send is waited out first
    session.close(linger=True)
    session.close()
    assert calls == [
        ("send", 1.0),  # the last loss seen, even before the start
        ("wait", 0.5),
        ("send", 0.4),
        ("wait", None),
        ("send", 0.4),
        ("wait", None),
        ("linger", 2.0),
        ("close",),
    ]
    assert session.stats() == {"state": "closed"} and session.send() is False
    # a second train()/fit() with the same callback: refused with one line, not trained alone in silence
    # (issue 42: the same callback exchanged 34 times in run 1 and 0 times in run 2, and said nothing)
    with pytest.raises(RuntimeError, match=r"closed at the end of the last train\(\)/fit\(\); make a new callback"):
        session.start(object())  # type: ignore[arg-type]


@pytest.mark.io
def test_importing_the_integrations_package_needs_no_framework_and_a_missing_extra_says_what_to_install():
    code = (
        "import sys; import dpwa.integrations, dpwa.integrations.env\n"
        "heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "sys.modules['lightning'] = None; sys.modules['transformers'] = None\n"
        "for extra in ('lightning', 'transformers'):\n"
        "    try:\n"
        "        __import__('dpwa.integrations.' + extra)\n"
        "    except ImportError as exc:\n"
        "        assert f\"pip install 'dpwa[{extra}]'\" in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError(extra)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.io
def test_under_dpwas_launcher_the_session_writes_the_nodes_metrics_lines(tmp_path, monkeypatch):
    """With $DPWA_RUN_DIR set (python -m dpwa run sets it), the callbacks' session writes start, step and end
    lines into RUN_DIR/metrics/NAME.jsonl, which the launcher's live table and the dashboard read."""
    import json

    import torch

    from conftest import make_config
    from dpwa.integrations.env import NodeEnv
    from dpwa.integrations.session import AdapterSession

    monkeypatch.setenv("DPWA_RUN_DIR", str(tmp_path))
    config = make_config(1, mode="pull")
    session = AdapterSession(NodeEnv(config, "w0"), {})
    net = torch.nn.Linear(3, 2)
    session.start(net)
    try:
        for step in range(7):
            session.send()
            session.wait(1.0 / (step + 1))
    finally:
        session.close(linger=True)
    lines = [json.loads(line) for line in (tmp_path / "metrics" / "w0.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["start", "step", "step", "end"]
    assert lines[0]["started"] == "started from the beginning" and lines[0]["rank"] == 0
    assert [r["step"] for r in lines[1:3]] == [5, 7]  # every 5 steps, and the last at close
    assert abs(lines[1]["loss"] - sum(1 / k for k in range(1, 6)) / 5) < 1e-9  # the mean since the last line
    assert lines[3]["reason"] == "done" and lines[3]["step"] == 7 and lines[3]["stats"]["state"] == "closed"
    # its final weights, as the run folder's last checkpoint: python -m dpwa average gives the mean model
    # (issue 48: a callback run had none, and average said no checkpoint holds every node's state)
    from dpwa.runfiles import checkpoints

    saved = checkpoints.load(tmp_path, checkpoints.LAST, "w0")
    assert set(saved) == {"model"} and all(torch.equal(saved["model"][k], v) for k, v in net.state_dict().items())
    from dpwa.cluster.average import average_run

    mean = average_run(tmp_path)
    assert all(torch.equal(mean.state_dict[k], v) for k, v in net.state_dict().items())  # one node: its own


@pytest.mark.io
@pytest.mark.timeout(60)
def test_under_dpwas_launcher_the_callbacks_nodes_start_together(tmp_path, monkeypatch):
    """Issue 48: under ./run.sh nothing started the nodes together, so the node whose imports finished first
    trained alone. Now each callback's node waits for the others at the ``start`` barrier before its first
    step (as train.py's nodes and torchrun's workers do): w0 waits until w1 starts, then both go on."""
    import threading

    import torch

    from conftest import make_config, wait_until
    from dpwa.integrations.env import NodeEnv
    from dpwa.integrations.session import START_BARRIER, AdapterSession

    monkeypatch.setenv("DPWA_RUN_DIR", str(tmp_path))
    config = make_config(2, mode="pull")
    sessions = [AdapterSession(NodeEnv(config, name), {}) for name in ("w0", "w1")]
    first = threading.Thread(target=sessions[0].start, args=(torch.nn.Linear(3, 2),), daemon=True)
    try:
        first.start()
        assert wait_until(lambda: sessions[0].adapter is not None, 20.0, 0.01)
        assert not wait_until(lambda: not first.is_alive(), 0.5, 0.02)  # it waits for w1
        sessions[1].start(torch.nn.Linear(3, 2))
        first.join(20.0)
        assert not first.is_alive()
        for session in sessions:
            assert session.adapter is not None and session.adapter.barrier_counters() == {START_BARRIER: 1}
    finally:
        first.join(20.0)
        for session in sessions:
            session.close()
