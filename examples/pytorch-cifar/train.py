"""Train one dpwa node: a small ResNet (CPU) or ResNet-18 (GPU) on CIFAR-10 or digits, or a character-level transformer.

Every node of a cluster runs this script with the same config and its own
--name. ``./run.sh`` starts one per core and shows them all; by hand, from the
repository root (after ./run.sh or ./test.sh made .venv), in two terminals:

    .venv/bin/python examples/pytorch-cifar/train.py --config samples/local-2.yaml --name w1 --epochs 5
    .venv/bin/python examples/pytorch-cifar/train.py --config samples/local-2.yaml --name w2 --epochs 5

    .venv/bin/python examples/pytorch-cifar/train.py --help

With ``--workload charlm`` a node trains the small GPT-style character-level
transformer of ``dpwa_lab.workloads.charlm`` on the Python standard library's
source (``--data stdlib``) or a text file (``--data text:PATH``), and
evaluates the validation loss (nats per character) every epoch (an epoch is
``--steps-per-epoch`` batches, 50 by default: its shard is large). It trains
with AdamW (lr 0.01, betas 0.9 and 0.95, weight decay 0.01), as
``python -m dpwa.compare --workload charlm`` does.

A node trains on its own disjoint shard of the training images (its position
in the config's node list; ``--shard none`` gives it all of them), exchanges
parameters with a peer around every batch, and evaluates on the test set
after every epoch. With ``--run-dir`` it appends one JSON line per logged
step and per evaluation to RUN_DIR/metrics/NAME.jsonl and saves its final
weights to RUN_DIR/models/NAME.pt. SIGTERM or Ctrl-C stops it after the
current batch: it saves the weights, writes a last metrics line and closes
the adapter; a second signal stops it at once.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import math
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import data as datasets
import models
import schedule as training_schedule
import text as texts
import torch
import torch.nn.functional as F
from evaluate import checkpoint, evaluate

import dpwa
from dpwa import DpwaPyTorchAdapter, TransportError
from dpwa.runfiles import checkpoints
from dpwa.runfiles.metrics import MetricsWriter, StepMetrics
from dpwa.runfiles.private import make_private_dir, write_private

# Defaults per dataset (digits, cifar10, charlm), and how they change with the number of nodes:
# schedule.py (on digits the learning rate grows with the nodes, with a warm-up; the warning when --epochs
# gives too few steps).
DEFAULTS = training_schedule.DEFAULTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="cluster YAML file (every node uses the same)")
    p.add_argument(
        "--name",
        help="which node of the config this process is (under torchrun with "
        "nodes: torchrun: left out, the worker is rank<RANK>)",
    )
    p.add_argument("--run-dir", type=Path, help="write metrics/NAME.jsonl and models/NAME.pt here")
    p.add_argument(
        "--workload",
        choices=texts.WORKLOADS,
        help="digits or cifar10 (a ResNet on images), or charlm (a character-level transformer on text); "
        "default: as --data says",
    )
    p.add_argument(
        "--data",
        default="auto",
        type=texts.data_source,
        help="images: auto (default: cifar10 if prepared in --data-dir, else the embedded digits), digits, "
        "cifar10; charlm: stdlib (default: the Python standard library's source) or text:PATH",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=datasets.DEFAULT_CIFAR_DIR,
        help="CIFAR-10 batches folder (default: data/cifar-10-batches-py next to this script)",
    )
    p.add_argument(
        "--shard",
        default="auto",
        choices=("auto", "none"),
        help="auto (default): a disjoint part per node, by its position in the config; none: all the data",
    )
    p.add_argument(
        "--model",
        default="auto",
        choices=("auto",) + models.MODELS + ("tiny",),
        help="images: auto (default): resnet18 on a GPU, small on a CPU; charlm: small (auto) or tiny",
    )
    p.add_argument(
        "--width", type=int, default=16, help="channels of the small model's first stage (default: %(default)s)"
    )
    p.add_argument(
        "--epochs",
        type=int,
        help="default: 20 on digits (more if needed for 100 steps per node), 30 on cifar10, 6 on charlm",
    )
    p.add_argument("--steps-per-epoch", type=int, help="cap on batches per epoch (quick trials; charlm: 50)")
    p.add_argument("--batch-size", type=int, help="default: 32 on digits, 128 on cifar10, 32 on charlm")
    p.add_argument(
        "--lr",
        type=float,
        help="peak learning rate, cosine decay to 0, on every node (default: 0.1 on "
        "cifar10, 0.01 on charlm; on digits 0.05 x nodes / 2, at most 0.4, "
        "after a warm-up)",
    )
    p.add_argument(
        "--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum, images only (default: %(default)s)"
    )
    p.add_argument(
        "--weight-decay", type=float, help="default: 5e-4 (SGD, images), 0.01 (AdamW's decoupled decay, charlm)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="initial weights, equal on every node; each node's data order differs (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (default): a GPU when there is one (nodes take the GPUs in turn), else cpu; or cpu, cuda, cuda:N",
    )
    p.add_argument("--log-every", type=int, default=5, help="steps between metrics lines (default: %(default)s)")
    p.add_argument(
        "--linger-s",
        type=float,
        default=60.0,
        help="after the last epoch, keep serving peers that still train, until none has fetched "
        "for a while or this many seconds passed (default: %(default)s; 0: exit at once)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from RUN_DIR's latest complete checkpoint (needs --run-dir)"
    )
    p.add_argument(
        "--barrier-timeout-s",
        type=float,
        default=300.0,
        help="how long a node waits at a barrier for missing nodes before it goes on without them "
        "(default: %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        args.workload, args.data = texts.resolve_workload(args.workload, args.data, args.data_dir)
    except ValueError as exc:
        p.error(str(exc))
    if args.workload == "charlm" and args.model not in ("auto", "small", "tiny"):
        p.error(f"--model for charlm must be small or tiny, got {args.model}")
    if args.workload != "charlm" and args.model == "tiny":
        p.error("--model tiny is a charlm size; the image workloads have small and resnet18")
    if args.resume and args.run_dir is None:
        p.error("--resume needs --run-dir (the run whose checkpoints to continue from)")
    for option in ("epochs", "steps_per_epoch", "batch_size", "width", "log_every"):
        value = getattr(args, option)
        if value is not None and value < 1:
            p.error(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    return args


class StopFlag:
    """Set by SIGTERM or SIGINT, so training stops after the current batch.

    A second Ctrl-C (SIGINT) stops at once; a repeated SIGTERM changes
    nothing (a launcher and stop.sh may both send one; SIGKILL is the escalation).
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signum, signal.default_int_handler)

    def __bool__(self) -> bool:
        return self.signal_name is not None


def params_blake2b(net: torch.nn.Module) -> str:
    """BLAKE2b (32 bytes) of the model's floating-point tensors in float32, in order: what a donor logs
    of the parameters it offers ("parameters blake2b ..."), so a join can be traced to its snapshot."""
    digest = hashlib.blake2b(digest_size=32)
    for tensor in list(net.parameters()) + [b for b in net.buffers() if b.is_floating_point()]:
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def node_state(
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    order: torch.Generator,
    conn: DpwaPyTorchAdapter,
    progress: dict[str, int],
) -> dict[str, Any]:
    """Everything a node needs to continue after its epoch: tensors, numbers and strings only."""
    return {
        "model": {k: v.detach().cpu() for k, v in net.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "dpwa": conn.checkpoint(),  # clock, barrier counters, the outer step's and the rule's state
        "progress": dict(progress),
        "rng": {"torch": torch.get_rng_state(), "order": order.get_state(), "python": random.getstate()},
    }


def position(config: dpwa.Config, args: argparse.Namespace) -> tuple[int, int]:
    """(this node's index, the number of nodes): from the config's node list, or from torchrun's RANK."""
    if config.torchrun:
        from dpwa.gossip.membership.rendezvous import TorchrunEnv

        env = TorchrunEnv.from_environ(source=config.source)
        if args.name not in (None, env.name):
            raise dpwa.ConfigError(f"{config.source}: under torchrun this worker is {env.name}, not {args.name}")
        return env.rank, env.world_size
    if args.name is None:
        raise dpwa.ConfigError(f"{config.source}: --name is needed: which node of the config is this?")
    config.node(args.name)  # a ConfigError lists the known node names
    return [n.name for n in config.nodes].index(args.name), len(config.nodes)


def describe_checkpoint(epoch: int | str) -> str:
    return "the state saved when it was stopped" if epoch == checkpoints.LAST else f"the checkpoint of epoch {epoch}"


def restart_count() -> int:
    """How many times torchrun has started this worker group again (0: the first time)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def resume_or_rejoin(
    args: argparse.Namespace,
    conn: DpwaPyTorchAdapter,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    order: torch.Generator,
    progress: dict[str, int],
    steps: int,
) -> str:
    """Where this node starts; fills `progress` and says which, in words. In this order:

    1. --resume: the state it saved when it was stopped, or else the run's latest complete checkpoint;
    2. it was stopped mid-run (SIGTERM, as torchrun stops every worker to start them all again): the state
       it saved then;
    3. it joined a cluster that has trained (it started late, or again after a crash): where the cluster is;
    4. torchrun started every worker again and this one saved nothing (it was the one that died): where
       the others are, once they have restored their state;
    5. it was started again and no peer could give it their state: its own latest checkpoint;
    6. otherwise, the beginning.
    """
    names = [n.name for n in conn.node.config.nodes]  # resolved: under torchrun too
    own_last = args.run_dir is not None and checkpoints.has(args.run_dir, checkpoints.LAST, args.name)
    if args.resume or own_last:
        epoch = checkpoints.LAST if own_last else checkpoints.latest_complete(args.run_dir, names)
        if epoch is None:
            raise checkpoints.CheckpointError(f"{args.run_dir}: no complete checkpoint of {', '.join(names)} to resume")
        load_checkpoint(args, epoch, conn, optimizer, schedule, order, progress)
        checkpoints.discard(args.run_dir, checkpoints.LAST, args.name)  # taken up, or older than what was
        return f"{'resumed' if args.resume else 'restarted'} from {describe_checkpoint(epoch)}"
    if not (conn.joined is not None and conn.joined.rejoined) and restart_count() > 0:
        conn.join(wait_s=max(60.0, args.barrier_timeout_s / 5))
    if conn.joined is not None and conn.joined.rejoined:
        progress["epoch"] = conn.barrier_counters().get("epoch", 0)
        progress["step"] = progress["epoch"] * steps
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": deliberate here
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(progress["step"]):  # the learning rate where the cluster's is
                schedule.step()
        order.manual_seed(order.initial_seed() + 7919 * progress["epoch"])  # a batch order of its own
        return f"joined the cluster at epoch {progress['epoch'] + 1} from {conn.joined.donor}"
    own = (
        [e for e in checkpoints.epochs(args.run_dir) if checkpoints.has(args.run_dir, e, args.name)]
        if (args.run_dir is not None)
        else []
    )
    if own:  # started again, and no peer had trained: our own last checkpoint is the freshest state we know
        load_checkpoint(args, own[-1], conn, optimizer, schedule, order, progress)
        return f"started again from its own checkpoint of epoch {own[-1]} (no peer could give it its state)"
    if conn.joined is not None:
        return f"started from {conn.joined.donor}'s initial parameters"
    return "started from the beginning"


def load_checkpoint(
    args: argparse.Namespace,
    epoch: int | str,
    conn: DpwaPyTorchAdapter,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    order: torch.Generator,
    progress: dict[str, int],
) -> None:
    """Continue from this node's checkpoint of `epoch` (hash checked, weights_only loading)."""
    state = checkpoints.load(args.run_dir, epoch, args.name)
    conn.net.load_state_dict(state["model"])  # in place: the adapter keeps blending the same tensors
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    conn.restore_checkpoint(state["dpwa"])
    order.set_state(state["rng"]["order"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    progress.update(state["progress"])


def pick_device(choice: str, index: int) -> torch.device:
    if choice != "auto":
        return torch.device(choice)
    if torch.cuda.is_available():  # nodes on one machine share its GPUs round-robin
        return torch.device(f"cuda:{index % torch.cuda.device_count()}")
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("train")

    try:
        config = dpwa.load_config(args.config)  # a ConfigError names the file, the key and the problem
        index, count = position(config, args)  # picks this node's shard and GPU
    except dpwa.ConfigError as exc:
        log.error("%s", exc)
        return 2
    data_name = args.workload
    defaults = DEFAULTS[data_name]
    batch_size = args.batch_size or defaults["batch_size"]
    lr, lr_scale = training_schedule.learning_rate(data_name, count, args.lr)  # grows with the nodes (schedule.py)
    device = pick_device(args.device, index)
    if data_name == "charlm":
        model_name = "small" if args.model == "auto" else args.model
    else:
        model_name = args.model if args.model != "auto" else ("resnet18" if device.type == "cuda" else "small")

    try:
        if data_name == "charlm":  # a node's shard of the text, or all of it
            data = texts.TextTask(args.data, model_name, index if args.shard == "auto" else None, count)
        else:
            data = datasets.load(data_name, args.data_dir)
            if args.shard == "auto":
                data = data.shard(index, count, seed=args.seed)
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s: %s", args.name, exc)
        return 2
    charlm = isinstance(data, texts.TextTask)
    full_epoch = data.steps_per_epoch(batch_size) if charlm else datasets.steps_per_epoch(data, batch_size)
    if full_epoch == 0:
        size = f"{len(data.train):,} training characters" if charlm else f"{len(data.train_y)} training images"
        log.error("%s: %s are fewer than one batch of %d", args.name, size, batch_size)
        return 2
    steps = min(full_epoch, args.steps_per_epoch or defaults.get("steps_per_epoch") or full_epoch)
    epochs = args.epochs or training_schedule.default_epochs(data_name, full_epoch)
    shard = len(data.train) if charlm else len(data.train_y)
    too_few = training_schedule.few_steps_warning(data_name, count, shard, batch_size, steps, epochs)
    if too_few:
        log.warning("%s: %s", args.name, too_few)

    torch.manual_seed(args.seed)  # same initial weights on every node (and joining makes sure of it)
    if charlm:
        net = data.build().to(device)
    else:
        net = models.build(model_name, data.in_channels, data.num_classes, args.width).to(device)
    weight_decay = args.weight_decay if args.weight_decay is not None else defaults.get("weight_decay", 5e-4)
    if charlm:
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    else:
        optimizer = torch.optim.SGD(
            net.parameters(), lr=lr, momentum=args.momentum, weight_decay=weight_decay, nesterov=True
        )
    total_steps = epochs * steps
    warmup = training_schedule.warmup_steps(lr_scale, steps, total_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: training_schedule.lr_factor(s, total_steps, warmup)
    )
    order = torch.Generator().manual_seed(args.seed * 1000 + index + 1)  # each node its own batch order

    try:  # with join: auto (the default) a node that starts late or restarts takes a peer's state here
        conn = DpwaPyTorchAdapter(net, args.name, config, optimizer=optimizer)
    except (TransportError, dpwa.ConfigError) as exc:  # e.g. the port is in use; torchrun's store out of reach
        log.error("%s", exc)
        return 2
    args.name = conn.name  # rank<RANK> under torchrun
    progress = {"epoch": 0, "step": 0, "averaged": 0, "failed": 0}  # what a checkpoint keeps besides the state
    try:
        started = resume_or_rejoin(args, conn, optimizer, schedule, order, progress, steps)
    except checkpoints.CheckpointError as exc:
        log.error("%s: %s", args.name, exc)
        conn.close()
        return 2
    metrics = MetricsWriter(args.run_dir, args.name)  # dpwa.runfiles.metrics: the lines every tool reads
    sizes = (
        {"train_chars": len(data.train), "valid_chars": data.valid_chars}
        if charlm
        else {"train_images": len(data.train_y), "test_images": len(data.test_y)}
    )
    metrics.write(
        "start",
        pid=os.getpid(),
        data=data_name if not charlm else data.name,
        model=model_name,
        device=str(device),
        parameters=models.count_parameters(net),
        **sizes,
        epochs=epochs,
        steps_per_epoch=steps,
        batch_size=batch_size,
        lr=lr,
        warmup_steps=warmup,
        started=started,
        first_epoch=progress["epoch"] + 1,
        clock=conn.clock,
        joined=None
        if conn.joined is None
        else {
            "donor": conn.joined.donor,
            "clock": conn.joined.clock,
            "digest": conn.joined.digest.hex(),
            "params_blake2b": params_blake2b(net),
        },
    )
    log.info(
        "%s: %s on %s (%s), %s with %s parameters on %s, %d epochs of %d steps, learning rate %g%s; %s",
        args.name,
        data.name if charlm else data_name,
        "its shard" if args.shard == "auto" else "all the data",
        f"{len(data.train):,} training characters" if charlm else f"{len(data.train_y)} training images",
        model_name,
        f"{models.count_parameters(net):,}",
        device,
        epochs,
        steps,
        lr,
        f" ({lr_scale:g} x the 2-node rate, warm-up {warmup} steps)" if lr_scale > 1 else "",
        started,
    )

    step, loss_value = progress["step"], None
    # the step and end lines, from the node's counters on top of what the run counted before a resume
    meter = StepMetrics(
        metrics, conn.stats, args.log_every, averaged_before=progress["averaged"], failed_before=progress["failed"]
    )
    exchanges = meter.exchanges
    averaged, averaged_with = exchanges()
    train_start = time.monotonic()
    epoch, reason = progress["epoch"], "error"
    completed = progress["epoch"]  # the last epoch whose steps all ran (a stopped node goes on after it)

    def barrier(name: str) -> list[str]:
        """Wait for every node at the barrier (going on without missing ones after the timeout)."""
        t0 = time.monotonic()
        # A SIGTERM (torchrun's, stop.sh's) ends the wait at once: the node saves its state and exits.
        skipped = conn.barrier(name, timeout_s=args.barrier_timeout_s, missing="proceed", stop=lambda: bool(stop))
        metrics.write(
            "barrier",
            name=name,
            epoch=epoch,
            step=step,
            waited_s=round(time.monotonic() - t0, 3),
            skipped=skipped,
            **({"stopped": True} if stop else {}),
        )
        return skipped

    try:
        if conn.barrier_counters().get("start", 0) == 0:  # a rejoined or resumed node passed it already
            barrier("start")
        for epoch in range(progress["epoch"] + 1, epochs + 1):
            net.train()
            epoch_batches = data.batches(batch_size, order) if charlm else datasets.batches(data, batch_size, order)
            for epoch_step, (x, y) in enumerate(epoch_batches, start=1):
                if stop or epoch_step > steps:
                    break
                conn.update_send(loss_value, batch_size=len(y))
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss = data.loss(net, x, y) if charlm else F.cross_entropy(net(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                loss_value = loss.item()
                update = conn.update_wait(loss_value)
                step += 1
                meter.step(
                    step,
                    loss_value,
                    update,
                    force=epoch_step == steps,
                    epoch=epoch,
                    epoch_step=epoch_step,
                    lr=optimizer.param_groups[0]["lr"],
                )
            if stop:
                break
            completed = epoch  # counted at the barrier below: a node stopped there resumes with the next epoch
            barrier("epoch")  # every node ends epoch `epoch` here, so all evaluate the same boundary
            averaged, averaged_with = exchanges()
            if stop:
                break
            if args.run_dir is not None:
                progress.update(epoch=epoch, step=step, averaged=averaged, failed=meter.failed)
                try:
                    saved = checkpoints.save(
                        args.run_dir, epoch, args.name, node_state(net, optimizer, schedule, order, conn, progress)
                    )
                except checkpoints.CheckpointError as exc:  # a full disk: train on, the last good one stays
                    log.warning("%s: checkpoint of epoch %d not saved: %s", args.name, epoch, exc)
                    metrics.write("checkpoint_failed", epoch=epoch, step=step, error=str(exc))
                else:
                    metrics.write("checkpoint", epoch=epoch, step=step, file=str(saved))
            if charlm:
                result = data.evaluate(net, device, should_stop=lambda: bool(stop))
            else:
                result = evaluate(net, data, device, should_stop=lambda: bool(stop))
            if result is None:
                break
            acc, test_loss = result
            if charlm:  # test_acc: next-character accuracy; test_loss: the validation loss
                bits = test_loss / math.log(2)
                metrics.write(
                    "eval",
                    epoch=epoch,
                    step=step,
                    test_acc=acc,
                    test_loss=test_loss,
                    val_loss=test_loss,
                    bits_per_char=bits,
                )
                measured = f"validation loss {test_loss:.4f} nats/char ({bits:.3f} bits/char)"
            else:
                metrics.write("eval", epoch=epoch, step=step, test_acc=acc, test_loss=test_loss)
                measured = f"test accuracy {100 * acc:.2f}% (test loss {test_loss:.4f})"
            log.info(
                "%s: epoch %d/%d step %d: loss %.4f, %s; averaged %d times, %d fetches failed",
                args.name,
                epoch,
                epochs,
                step,
                loss_value if loss_value is not None else float("nan"),
                measured,
                averaged,
                meter.failed,
            )
        # Once per node: a node restarted after its exit barrier (its counters restored) does not wait again.
        skipped = barrier("exit") if not stop and conn.barrier_counters().get("exit", 0) == 0 else []
        if not stop and args.linger_s > 0:
            # After the exit barrier every node has trained its last step; only requests in flight remain,
            # unless the barrier went on without someone, who may still train and fetch from us.
            step_s = (time.monotonic() - train_start) / max(step - progress["step"], 1)
            idle_s = max(2.0, 4 * step_s, 2 * conn.node.config.timeout_s) if skipped else 2 * conn.node.config.timeout_s
            metrics.write("linger", idle_s=idle_s, limit_s=args.linger_s)
            log.info("%s: serving peers that still train (until none fetched for %.1f s)", args.name, idle_s)
            spent = conn.linger(idle_s, args.linger_s, stop=lambda: bool(stop))
            log.info("%s: stopped serving after %.1f s", args.name, spent)
        reason = f"stopped by {stop.signal_name}" if stop else "done"
    except KeyboardInterrupt:  # the second Ctrl-C
        reason = "stopped at once by a second SIGINT"
    finally:
        stats = conn.stats()
        averaged, averaged_with = exchanges(stats)
        conn.close()
        if args.run_dir is not None:
            saved = args.run_dir / "models" / f"{args.name}.pt"
            try:
                make_private_dir(saved.parent, base=args.run_dir)
                buffer = io.BytesIO()  # torch.save into a file turns a full disk into a RuntimeError
                torch.save(data.checkpoint(net) if charlm else checkpoint(net, model_name, args.width, data), buffer)
                write_private(saved, buffer.getvalue())  # mode 0600, never a half-written file
            except OSError as exc:
                log.error("%s: %s: final weights not saved (%s)", args.name, saved, exc.strerror or exc)
        if stop and args.run_dir is not None:  # stopped mid-run: keep our state for a restart (torchrun's, say)
            progress.update(epoch=completed, step=step, averaged=averaged, failed=meter.failed)
            try:
                checkpoints.save(
                    args.run_dir,
                    checkpoints.LAST,
                    args.name,
                    node_state(net, optimizer, schedule, order, conn, progress),
                )
            except checkpoints.CheckpointError as exc:  # a restart takes the last complete epoch instead
                log.error("%s: state at stop not saved: %s", args.name, exc)
        meter.end(reason, stats, epoch=epoch, step=step)
        metrics.close()
        log.info(
            "%s: %s after %d steps; averaged %d times (%s), %d fetches failed",
            args.name,
            reason,
            step,
            averaged,
            ", ".join(f"{p}: {n}" for p, n in sorted(averaged_with.items())) or "none",
            meter.failed,
        )
    return 130 if reason.endswith("second SIGINT") else 0


if __name__ == "__main__":
    sys.exit(main())
