"""The mean of a cluster's weights: of a run folder's checkpoints, or of a live cluster's snapshots.

    from dpwa.cluster.average import mean_state_dict

    state = mean_state_dict("runs/latest")                   # the latest complete checkpoint of every node
    state = mean_state_dict("cluster.yaml", model=net)       # every node's current snapshot, over the wire
    net.load_state_dict(state)

    python -m dpwa average runs/latest -o mean.pt

The mean is element-wise over every floating-point tensor of the nodes'
state_dicts (parameters and floating buffers, such as BatchNorm's running
statistics), summed in float64 and given back in each tensor's own dtype:
nodes holding 0, 2 and 4 average to 2 exactly. A tensor that is not floating
point (BatchNorm's ``num_batches_tracked``, an integer step counter) is not
averaged: it is the *first* node's, in the order the nodes are listed (the
config's; for a run folder without ``launch.json``, by name). Every node's state must have the same tensor names, shapes and
dtypes, and every floating value must be finite: anything else is an
:class:`AverageError` naming the file (or the node) and the tensor.

**A run folder** (what ``./run.sh`` and ``train.py --run-dir`` write): each
node's state is read from the coordinated checkpoints of
:mod:`dpwa.runfiles.checkpoints` (``RUN_DIR/checkpoints/epoch-K/NODE.pt`` after
each epoch, ``checkpoints/last/NODE.pt`` when a node was stopped), hash
checked against the manifest and loaded with ``torch.load(weights_only=True)``.
The checkpoint is the *latest complete* one, as ``train.py --resume`` picks it
(:func:`~dpwa.runfiles.checkpoints.latest_complete`): every node's stopped
state when each has one, else the newest epoch that every node saved; so the
mean is taken at one point of the run. The nodes are those the run started on
this machine (``launch.json``), or, without one, every node any checkpoint
lists. A node with no state in any checkpoint, or no checkpoint that every node
saved, is an error naming the nodes and what each has; ``allow_missing=True``
(``--allow-missing``) averages those present instead: the freshest checkpoint
that the most nodes saved, and the result names the missing ones. ``epoch=K``
(or ``"last"``) picks a checkpoint. A checkpoint holds a node's whole state
(optimizer, counters, ...): its ``"model"`` entry is the state_dict averaged
(a checkpoint that is itself a state_dict is averaged as it is). The example's
``models/NODE.pt`` (final weights with the model's description) is what
``examples/pytorch-cifar/evaluate.py`` averages, with :func:`average_state_dicts`.

**A live cluster** (a config file): each node is sent one ``fetch`` (the
request a peer sends, without the ``rule`` field, so as a tool it is not
rule-checked), as ``python -m dpwa status`` asks: under CURVE with one node's
key pair (``key``), all nodes at once. A snapshot is one flat vector, so the
model is needed to name its pieces: ``model`` (an ``nn.Module`` built as the
nodes build theirs, with the adapter's ``include_buffers``) gives the layout,
as :class:`~dpwa.adapters.pytorch.TorchParams` flattens it (its fingerprint
must match the nodes', or they refuse the fetch). Tensors that no snapshot
carries (integer buffers) are ``model``'s own. Every node must answer.
Snapshots travel in the config's ``wire_dtype``, so with float16, bfloat16 or
int8 the mean is of the values as they travel. With ``wire_dtype: topk`` each
node sends the asking node's name its values in full, so that node's next real
fetch from it is in full too (once).

**Push-sum** (``rule: pushsum``): the cluster's mean weighs each node by its
push-sum weight. Checkpoints do not keep that weight (the rule keeps no
checkpoint state, and a restarted node starts again from weight 1), so a run
folder's mean is the plain mean; give ``weights`` (node -> weight, from each
node's ``stats()["rule.weight"]``) for the weighted one. A live cluster under
push-sum gives its plain mean too, with a note: a node gives half its weight
away with every snapshot it serves to a peer, but none to a tool's fetch (it
names no rule), so asking costs the cluster no weight, and tells it none.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..runfiles import checkpoints

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config

__all__ = [
    "Average",
    "AverageError",
    "average",
    "average_live",
    "average_run",
    "average_state_dicts",
    "mean_state_dict",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


class AverageError(ValueError):
    """The nodes' states cannot be averaged; the message names the file or node, and what is wrong."""


@dataclass(frozen=True)
class Average:
    """A mean of a cluster's weights, and where it came from."""

    state_dict: dict[str, torch.Tensor]  # loadable into the model (load_state_dict), savable with torch.save
    sources: dict[str, str]  # node -> the file its state was read from, or the endpoint it was fetched from
    checkpoint: int | str | None = None  # the run folder's epoch, or checkpoints.LAST; None for a live cluster
    missing: tuple[str, ...] = ()  # nodes left out (allow_missing): the mean is of the others
    weights: dict[str, float] | None = None  # node -> its weight in the mean; None: every node counts once
    notes: tuple[str, ...] = ()  # what a user should know about this mean, one line each


# --------------------------------------------------------------------------- the mean of state_dicts


class _Sum:
    """A running (weighted) sum of state_dicts, each checked against the first as it is added."""

    def __init__(self) -> None:
        self.first = ""
        self.layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.sums: dict[str, torch.Tensor] = {}
        self.total = 0.0

    def add(self, label: str, state: Any, weight: float = 1.0) -> None:
        if not isinstance(state, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
        ):
            raise AverageError(f"{label}: not a state_dict (a map of tensor names to tensors)")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise AverageError(f"{label}: its weight must be a finite number > 0, got {weight!r}")
        if not self.first:
            self.first = label
            self.layout = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
        elif state.keys() != self.layout.keys():
            missing = [k for k in self.layout if k not in state]
            extra = [k for k in state if k not in self.layout]
            raise AverageError(
                f"{label}: its tensor names differ from {self.first}'s"
                + (f"; it lacks {_few(missing)}" if missing else "")
                + (f"; it has {_few(extra)} that {self.first} lacks" if extra else "")
            )
        for key, tensor in state.items():
            shape, dtype = self.layout[key]
            if (tuple(tensor.shape), tensor.dtype) != (shape, dtype):
                raise AverageError(
                    f"{label}: {key} is {_kind(tuple(tensor.shape), tensor.dtype)}, "
                    f"in {self.first} {_kind(shape, dtype)}"
                )
            if tensor.is_floating_point():
                if not bool(torch.isfinite(tensor).all()):
                    raise AverageError(f"{label}: {key} holds NaN or Inf")
                part = tensor.detach().to("cpu", torch.float64) * weight
                if key in self.sums:
                    self.sums[key] += part
                else:
                    self.sums[key] = part
            elif key not in self.sums:  # not averaged: the first state's
                self.sums[key] = tensor.detach().to("cpu").clone()
        self.total += weight

    def mean(self) -> dict[str, torch.Tensor]:
        if not self.first:
            raise AverageError("no states to average")
        return {
            key: (self.sums[key] / self.total).to(dtype) if dtype.is_floating_point else self.sums[key]
            for key, (_, dtype) in self.layout.items()
        }


def _few(names: list[str], at_most: int = 5) -> str:
    shown = ", ".join(names[:at_most])
    return shown + (f" (and {len(names) - at_most} more)" if len(names) > at_most else "")


def _kind(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).replace('torch.', '')}"


def average_state_dicts(
    states: Mapping[str, Mapping[str, torch.Tensor]], weights: Mapping[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """The element-wise mean of `states` (label -> state_dict; a label, such as a file name, is what an error
    names): floating-point tensors averaged (weighted by `weights`, label -> weight > 0, when given), every
    other tensor the first state's. AverageError if the names, shapes or dtypes differ, or a value is NaN/Inf."""
    total = _Sum()
    for label, state in states.items():
        total.add(label, state, _weight_of(weights, label))
    return total.mean()


def _weight_of(weights: Mapping[str, float] | None, name: str) -> float:
    if weights is None:
        return 1.0
    if name not in weights:
        raise AverageError(f"{name}: no weight given for it (weights lists {_few(sorted(weights))})")
    return weights[name]


# --------------------------------------------------------------------------- a run folder


def _describe(epoch: int | str) -> str:
    return "last (the state saved when stopped)" if epoch == checkpoints.LAST else f"epoch {epoch}"


def _run_nodes(run_dir: PathLike) -> list[str]:
    """The nodes of a run folder: those it started on this machine (launch.json), else every node any of its
    checkpoints lists (sorted)."""
    run_dir = Path(run_dir)
    if (run_dir / "launch.json").exists():
        from .launch import LaunchSpec

        return LaunchSpec.load(run_dir).local_names
    names: set[str] = set()
    every: list[int | str] = [checkpoints.LAST, *checkpoints.epochs(run_dir)]
    for epoch in every:
        with contextlib.suppress(checkpoints.CheckpointError):
            names.update(checkpoints.manifest(run_dir, epoch).get("files", {}))
    return sorted(names)


def _uses_weights(run_dir: Path) -> str:
    """The run's mixing rule, when its config says it carries a weight (push-sum); '' otherwise or unknown."""
    from ..config import ConfigError, load_config
    from ..mixing.rules import rule_class

    try:
        config = load_config(run_dir / "config.yaml")
        return config.rule if "weight" in rule_class(config.rule).carries else ""
    except (ConfigError, OSError, ValueError, ImportError):
        return ""


def average_run(
    run_dir: PathLike,
    *,
    epoch: int | str | None = None,
    allow_missing: bool = False,
    weights: Mapping[str, float] | None = None,
) -> Average:
    """The mean of a run folder's nodes' states in one checkpoint (see the module docstring).

    Args:
        run_dir: a run folder, such as ``runs/latest``.
        epoch: the checkpoint: an epoch, or ``"last"`` (checkpoints.LAST); None: the latest complete one.
        allow_missing: average the nodes present when some have no state in the checkpoint (listed in
            ``missing``); without it that is an AverageError naming them.
        weights: node -> weight > 0, for a weighted mean (push-sum's weights); None: the plain mean.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AverageError(f"{run_dir}: no such run folder")
    nodes = _run_nodes(run_dir)
    if not nodes:
        raise AverageError(f"{run_dir}: no checkpoints (no {run_dir / 'checkpoints'}/epoch-K/manifest.json)")
    # every checkpoint, freshest first (a stopped node's state comes after its epochs'), with the nodes it holds
    order: list[int | str] = [checkpoints.LAST, *reversed(checkpoints.epochs(run_dir))]
    held: dict[int | str, list[str]] = {}
    damaged: dict[int | str, str] = {}  # a manifest that fails its check: nothing it lists is used
    for c in order:
        try:
            files = checkpoints.manifest(run_dir, c).get("files", {})
        except checkpoints.CheckpointError as exc:
            held[c], damaged[c] = [], str(exc)
            continue
        folder = checkpoints.checkpoint_dir(run_dir, c)
        held[c] = [n for n in nodes if n in files and (folder / files[n]["file"]).is_file()]  # names checked
    notes = [f"skipped: {problem}" for problem in damaged.values() if epoch is None]
    if epoch is not None:
        if epoch != checkpoints.LAST and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
            raise AverageError(f"epoch must be an integer >= 0 or 'last', got {epoch!r}")
        chosen = epoch
        if chosen in damaged:
            raise AverageError(damaged[chosen])
        if not held.get(chosen):
            have = ", ".join(_describe(c) for c in order if held[c]) or "none"
            raise AverageError(f"{checkpoints.checkpoint_dir(run_dir, chosen)}: no checkpoint here (have: {have})")
    else:
        complete = [c for c in order if len(held[c]) == len(nodes)]
        if complete:
            chosen = complete[0]
        elif allow_missing and any(held.values()):
            chosen = max(order, key=lambda c: len(held[c]))  # the most nodes; max keeps the freshest of a tie
        else:
            has = {n: [_describe(c) for c in order if n in held[c]] for n in nodes}
            detail = "; ".join(f"{n}: {', '.join(h) if h else 'none'}" for n, h in has.items())
            raise AverageError(
                f"{run_dir}: no checkpoint holds every node's state ({detail}); --allow-missing "
                "(allow_missing=True) averages the nodes of the checkpoint most of them saved"
            )
        newer = [c for c in order[: order.index(chosen)] if held[c]]
        if newer:
            notes.append(
                "newer checkpoints lack some nodes: "
                + "; ".join(f"{_describe(c)} ({', '.join(n for n in nodes if n not in held[c])})" for c in newer)
            )
    missing = tuple(n for n in nodes if n not in held[chosen])
    if missing and not allow_missing:
        where = checkpoints.checkpoint_dir(run_dir, chosen) / "manifest.json"
        raise AverageError(f"{where}: no state of {', '.join(missing)} in {_describe(chosen)}")
    if missing:
        notes.append(f"missing: {', '.join(missing)} (no state in {_describe(chosen)}): the mean is of the others")
    rule = _uses_weights(run_dir)
    if rule and weights is None:
        notes.append(
            f"rule {rule}: the checkpoints keep no {rule} weight, so this is the plain mean of the nodes; "
            "the cluster's own mean weighs each node by its weight"
        )
    used = [n for n in nodes if n in held[chosen]]
    total = _Sum()
    sources: dict[str, str] = {}
    for node in used:  # one checkpoint in memory at a time, besides the sum
        path = checkpoints.checkpoint_dir(run_dir, chosen) / f"{node}.pt"
        try:
            state = checkpoints.load(run_dir, chosen, node)
        except checkpoints.CheckpointError as exc:
            raise AverageError(str(exc)) from None
        model = state.get("model")
        total.add(str(path), model if isinstance(model, Mapping) else state, _weight_of(weights, node))
        sources[node] = str(path)
    return Average(
        state_dict=total.mean(),
        sources=sources,
        checkpoint=chosen,
        missing=missing,
        weights=None if weights is None else {n: float(weights[n]) for n in used},
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- a live cluster


def _unflatten(flat: torch.Tensor, model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """`model`'s state_dict with the tensors named in `names` (TorchParams' order) taken from `flat`."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters())
    own.update(model.named_buffers())
    pieces: dict[int, torch.Tensor] = {}  # id of the model's tensor -> its values in the snapshot
    offset = 0
    for name in names:
        tensor = own[name]
        pieces[id(tensor)] = flat[offset : offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
        offset += tensor.numel()
    if offset != flat.numel():
        raise AverageError(f"a snapshot of {flat.numel()} values, the model has {offset}")
    # keep_vars: the same tensor objects, so a tied weight's second name finds its values too
    return {
        key: pieces[id(value)] if id(value) in pieces else value.detach().cpu()
        for key, value in model.state_dict(keep_vars=True).items()
    }


def average_live(
    config: PathLike | Config,
    model: nn.Module,
    *,
    include_buffers: bool = True,
    key: str | None = None,
    timeout_s: float | None = None,
) -> Average:
    """The mean of every node's current snapshot, fetched over the wire (see the module docstring).

    Args:
        config: the cluster's config file (or a loaded Config).
        model: a model like the nodes' (its values are not used, but for tensors no snapshot carries).
        include_buffers: as the nodes' adapters were made (their ``include_buffers``).
        key: under CURVE, ask as this node, with its key pair (default: the first node whose secret key
            file is readable here); without CURVE, the name to ask as (default: the first node).
        timeout_s: how long to wait for the nodes' snapshots (default: the config's timeout_ms).
    """
    import numpy as np
    import zmq

    from ..adapters.pytorch import TorchParams
    from ..config import load_config
    from ..gossip.settings import rule_of
    from ..gossip.transfer.join import CHUNK_BYTES
    from ..gossip.transfer.requesting import FetchTask, Received, ReplyReader
    from ..gossip.transfer.validation import PeerValues
    from ..mixing.model import WireModel
    from ..stats import Counters
    from ..wire.client import ClientThread
    from ..wire.schema import LARGEST_HEADER_BYTES
    from .status import asker, reachable

    config = config if not isinstance(config, (str, os.PathLike)) else load_config(config)
    reachable(config)
    rule = rule_of(config)
    notes = []
    if rule.carries:  # a tool's fetch names no rule: the nodes send their values and keep what they carry
        notes.append(
            f"rule {rule.name}: the nodes send a tool no {', '.join(rule.carries)}, so this is the plain mean of "
            "the nodes; the cluster's own mean weighs each node by its weight"
        )
    name, curve = asker(config, key)
    params = TorchParams(model, include_buffers=include_buffers)
    wire = WireModel(params.fingerprint, config.wire_of(params.natural_wire), params.size, None, config.wire_options)
    deadline = time.monotonic() + (config.timeout_s if timeout_s is None else timeout_s)
    total = _Sum()
    sources: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        ctx = zmq.Context()
        stack.callback(ctx.destroy, 0)  # after every client thread closed its sockets
        calls = {}
        for spec in config.nodes:  # a client (and a reader) per node, so dead nodes cost one timeout in all
            endpoint = config.endpoint(spec)
            options = {spec.name: curve.client_options((spec.public_key or "").encode())} if curve else None
            reader = ReplyReader(
                wire, PeerValues(wire.kept, 0.0, lambda: None), {}, Counters(), logger.info, sealed=config.secure
            )
            stack.callback(reader.close)
            client = ClientThread(
                ctx,
                {spec.name: endpoint},
                name="average",
                max_reply_bytes=max(wire.nbytes, LARGEST_HEADER_BYTES, CHUNK_BYTES),
                socket_options=options,
            ).start()
            stack.callback(client.close)  # before its reader: frames are given back on its thread
            calls[spec.name] = (endpoint, client.submit(FetchTask(spec.name, deadline, name, reader)))
        for node, (endpoint, call) in calls.items():
            label = f"{node} ({endpoint})"
            if not call.wait(max(0.0, deadline - time.monotonic()) + 1.0):
                call.abandon()
                raise AverageError(f"{label}: no snapshot in time")
            if call.outcome != "ok":
                raise AverageError(f"{label}: no snapshot: {call.outcome}: {call.reason}")
            received: Received = call.take()
            with received:
                if received.header["from"] != node:
                    raise AverageError(f"{label}: answered as {received.header['from']!r}")
                array = received.array
                if wire.kept == "bfloat16":  # kept as uint16
                    flat = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16).float()
                else:
                    flat = torch.from_numpy(array.astype(np.float32))  # a copy: the buffer goes back
            total.add(label, _unflatten(flat, model, params.names))
            sources[node] = endpoint
    return Average(state_dict=total.mean(), sources=sources, notes=tuple(notes))


# --------------------------------------------------------------------------- either


def average(
    source: PathLike | Config,
    *,
    model: nn.Module | None = None,
    epoch: int | str | None = None,
    allow_missing: bool = False,
    weights: Mapping[str, float] | None = None,
    include_buffers: bool = True,
    key: str | None = None,
    timeout_s: float | None = None,
) -> Average:
    """:func:`average_run` of a run folder, or :func:`average_live` of a config file (or Config), which needs
    `model`. Options that do not apply to the source are an AverageError."""
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        if model is not None or key is not None or timeout_s is not None:
            raise AverageError(f"{source} is a run folder: model, key and timeout_s are for a live cluster")
        return average_run(source, epoch=epoch, allow_missing=allow_missing, weights=weights)
    if epoch is not None or allow_missing or weights is not None:
        raise AverageError(f"{source}: epoch, allow_missing and weights are for a run folder")
    if isinstance(source, (str, os.PathLike)) and not Path(source).exists():
        raise AverageError(f"{source}: no such run folder or config file")
    if model is None:
        raise AverageError(
            f"{source}: a live cluster's snapshots are flat vectors; give model= (a model like the nodes') "
            "to name their tensors"
        )
    return average_live(source, model, include_buffers=include_buffers, key=key, timeout_s=timeout_s)


def mean_state_dict(
    source: PathLike | Config,
    *,
    model: nn.Module | None = None,
    epoch: int | str | None = None,
    allow_missing: bool = False,
    weights: Mapping[str, float] | None = None,
    include_buffers: bool = True,
    key: str | None = None,
    timeout_s: float | None = None,
) -> dict[str, torch.Tensor]:
    """The mean of every node's state_dict: of a run folder's latest complete checkpoint, or of a live
    cluster's snapshots (a config file, and `model`). :func:`average`'s ``state_dict``; see it for the rest."""
    return average(
        source,
        model=model,
        epoch=epoch,
        allow_missing=allow_missing,
        weights=weights,
        include_buffers=include_buffers,
        key=key,
        timeout_s=timeout_s,
    ).state_dict
