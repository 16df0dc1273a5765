"""PyTorch adapter: gossip averaging for an ``nn.Module`` with two calls per batch.

Example::

    from dpwa import DpwaPyTorchAdapter

    conn = DpwaPyTorchAdapter(net, "w1", "cluster.yaml")
    loss = None                                # no loss before the first batch
    for inputs, targets in loader:
        conn.update_send(loss)                 # publish; maybe start an exchange
        loss = train_batch(net, inputs, targets)
        conn.update_wait(loss)                 # blend the peer's parameters in place
    conn.close()

Or, with the loop left as it is, :func:`dpwa.adapters.hook.gossip_optimizer`.

Parameters and floating-point buffers (BatchNorm running statistics) are
blended in place, under ``torch.no_grad()``: their storage is never replaced,
so optimizers and anything else holding a reference keep working. Integer
buffers (``num_batches_tracked``) are left alone. Buffers always blend
convexly: where parameters move by the difference of two snapshots (``rule:
delta``), a buffer moves towards the peer's instead (``x += f (peer - x)``),
so a running variance stays positive whatever the peers' statistics. On CUDA, snapshots are
copied into pinned host memory, and received parameters go through one pinned
staging buffer to one flat device buffer before the in-place blend. Blending
is done in float32 whatever the wire dtype, over one flat work buffer the
tensors are gathered into, and the result is written back into each tensor
(converted to its dtype): a few flat operations, not one per tensor.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
from torch import nn

from ..config import Config
from ..gossip.node import Node, Update
from ..gossip.setup import as_config
from ..gossip.transfer.protocol import MAX_VALUE
from ..logs import logger
from ..mixing import kernels
from ..mixing.params import FlatParams, checked_vector, fingerprint
from .outer import OuterOptimizerFactory, TorchOuter

__all__ = ["CHUNKED_MIN_ELEMENTS", "CHUNK_ELEMENTS", "DpwaPyTorchAdapter", "OptimizerState", "TorchParams"]

# A model larger than this is blended chunk by chunk, each tensor in place, instead of through one flat
# float32 work buffer of the model's size: its scratch is three chunks (12 MiB; four for a half-precision
# model on a half-precision wire), not a copy of the model. On CUDA each chunk of a snapshot goes through a
# pinned host buffer of a chunk's size to a device buffer of a chunk's size, and a publish comes back the same
# way: all of them made once, at first use, and reused (docs/design.md#memory).
START_BARRIER = "start"  # the barrier nodes meet at before their first step, under dpwa's launcher (train.py's too)
START_WAIT_S = 60.0  # the longest start_together waits there for the others before it goes on without them
CHUNKED_MIN_ELEMENTS = 1 << 22  # 16 MiB in float32
CHUNK_ELEMENTS = 1 << 20


class TorchParams(FlatParams):
    """An ``nn.Module``'s parameters (and floating buffers) seen as one flat float32 vector.

    Args:
        module: the model. Every blended tensor must be floating point and
            all of them must live on one device.
        include_buffers: also blend floating-point buffers (BatchNorm running
            statistics). Integer buffers are never blended.
    """

    def __init__(self, module: nn.Module, include_buffers: bool = True) -> None:
        named: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
        n_params = len(named)
        if include_buffers:
            named += [(n, b) for n, b in module.named_buffers() if b is not None and b.is_floating_point()]
        if not named:
            raise ValueError(f"{type(module).__name__} has no parameters to average")
        for tensor_name, tensor in named:
            if not tensor.is_floating_point():
                raise ValueError(
                    f"parameter {tensor_name!r} is {tensor.dtype}; only floating-point tensors can be averaged"
                )
        devices = {t.device for _, t in named}
        if len(devices) != 1:
            raise ValueError(f"all averaged tensors must be on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.names = [n for n, _ in named]
        self._tensors = [t.detach() for _, t in named]  # same storage; no autograd history
        self._sizes = [t.numel() for t in self._tensors]
        self.size = sum(self._sizes)
        self.fingerprint = fingerprint((n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in named)
        dtypes = {t.dtype for t in self._tensors}  # a model all in one half precision travels in it, whole
        half = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
        self.natural_wire = half[next(iter(dtypes))] if len(dtypes) == 1 and dtypes <= half.keys() else "float32"
        # Every op is a few flat ones over one work buffer: the tensors are gathered into it with one cat and
        # written back with one foreach call (a per-tensor op costs microseconds each; a small model has dozens).
        # Contiguous tensors are read through cached 1-D views of themselves; the rest are flattened per call.
        self._flat = [t.view(-1) if t.is_contiguous() else None for t in self._tensors]
        self._fast = [i for i, t in enumerate(self._tensors) if t.dtype == torch.float32 and t.is_contiguous()]
        self._fast_targets = [self._tensors[i].view(-1) for i in self._fast]
        self._slow = [i for i in range(len(self._tensors)) if i not in set(self._fast)]
        # buffers (running statistics) follow the parameters in `named`, so they fill the vector's tail from here
        self._first_stat, self._stats_from = n_params, sum(self._sizes[:n_params])
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device} is not supported; use a CPU or CUDA model")
        # A large model is blended in chunks, each tensor in place: no model-sized work buffer
        # (docs/design.md#memory), only CHUNK_ELEMENTS-sized scratch buffers (on CUDA, and pinned host ones).
        self._chunks = (
            _chunk_pieces(self._sizes, CHUNK_ELEMENTS)
            if self.size > CHUNKED_MIN_ELEMENTS and all(f is not None for f in self._flat)
            else None
        )
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}  # flat work buffers, made on first use
        self._work_views: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._work_np: tuple[np.ndarray, torch.Tensor | None, np.ndarray] | None = None

    def _buffer(self, where: str, wire: str, size: int | None = None) -> torch.Tensor:
        """A flat work buffer of dtype `wire`: a name starting "pinned" (host), or any other name (on the model's
        device); of the model's size unless `size` says otherwise (a chunk's scratch). Made once, then reused."""
        key = (where, wire)
        if key not in self._buffers:
            dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[wire]
            n = self.size if size is None else size
            if where.startswith("pinned"):
                self._buffers[key] = torch.empty(n, dtype=dtype, pin_memory=True)
            else:
                self._buffers[key] = torch.empty(n, dtype=dtype, device=self.device)
        return self._buffers[key]

    def scratch_nbytes(self) -> int:
        """The bytes of work buffers this adapter holds now (docs/design.md#memory)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def _chunk_source(self, array: np.ndarray, start: int, end: int, wire: str, slot: str) -> torch.Tensor:
        """Elements [start, end) of the flat `array` (of dtype `wire`) as float32 on the model's device: a view,
        or converted into the chunk scratch buffer `slot` (on CUDA: through a pinned chunk, then a device one)."""
        source = kernels.as_torch(kernels.aligned(array[start:end]), wire)
        n = end - start
        if self.device.type == "cuda":
            staging = self._buffer("pinned_" + slot, wire, CHUNK_ELEMENTS)[:n].copy_(source)
            # synchronous: the pinned chunk is written again for the next chunk as soon as this returns
            source = self._buffer("device_" + slot, wire, CHUNK_ELEMENTS)[:n].copy_(staging)
        if wire == "float32":
            return source
        return self._buffer(slot, "float32", CHUNK_ELEMENTS)[:n].copy_(source)

    def _copy_chunked(self, host: torch.Tensor, wire: str) -> None:
        """(A large CUDA model) Publish: each chunk of the tensors gathered on the device, converted to the
        wire's dtype there, and copied to the host (`host`: the snapshot, flat, of that dtype)."""
        assert self._chunks is not None
        chunk = self._buffer("device_out", wire, CHUNK_ELEMENTS)
        for start, end, pieces in self._chunks:
            for index, lo, hi, at in pieces:
                target = self._flat[index]
                assert target is not None
                chunk[at : at + hi - lo].copy_(target[lo:hi])
            host[start:end].copy_(chunk[: end - start])  # waits for the chunk's kernels: the buffer is reused

    def _blend_chunked(self, a: np.ndarray, b: np.ndarray | None, f: float, wire: str) -> None:
        """(A large CPU model) Chunk by chunk, each tensor's piece in place: ``x += f (a - b)`` for parameters
        and ``x += f (a - x)`` for running statistics; with `b` None, ``x += f (a - x)`` (lerp) for all.
        Float32 tensors get the same bits as the flat path; a lower-precision one is computed in float32
        and rounded once (the flat path adds in its dtype: the two may differ in the last bit)."""
        assert self._chunks is not None
        for start, end, pieces in self._chunks:
            first = self._chunk_source(a, start, end, wire, "chunk_a")
            second = self._chunk_source(b, start, end, wire, "chunk_b") if b is not None else None
            for index, lo, hi, at in pieces:
                target = self._flat[index]
                assert target is not None
                piece, peer = target[lo:hi], first[at : at + hi - lo]
                exact = piece.dtype == torch.float32
                x = piece if exact else self._buffer("chunk_x", "float32", CHUNK_ELEMENTS)[: hi - lo].copy_(piece)
                if second is None:  # lerp in float32, written back in the tensor's dtype
                    x.lerp_(peer, float(f))
                    if not exact:
                        piece.copy_(x)
                    continue
                diff = self._buffer("chunk_d", "float32", CHUNK_ELEMENTS)[: hi - lo]
                # running statistics move towards the peer's snapshot, as in the flat path
                torch.sub(peer, second[at : at + hi - lo] if index < self._first_stat else x, out=diff)
                x.add_(diff, alpha=float(f))
                if not exact:
                    piece.copy_(x)  # rounded once, from float32

    def _work(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The flat float32 work buffer on the model's device, and its per-tensor views (fast ones 1-D,
        the rest in their tensor's shape), made once."""
        work = self._buffer("work", "float32")
        if self._work_views is None:
            parts = work.split(self._sizes)
            fast = [parts[i] for i in self._fast]
            self._work_views = fast, [parts[i].view(self._tensors[i].shape) for i in self._slow]
        return work, *self._work_views

    def _gather(self, out: torch.Tensor, first: int = 0) -> None:
        """Tensors `first`, `first` + 1, ... concatenated into the flat `out` (converted to its dtype): one op."""
        if not self._slow:  # every tensor is a cached 1-D view: nothing to build per call
            torch.cat(self._fast_targets[first:], out=out)
            return
        pairs = zip(self._tensors[first:], self._flat[first:], strict=True)
        torch.cat([t.reshape(-1) if flat is None else flat for t, flat in pairs], out=out)

    def _add(self, pieces: tuple[list[torch.Tensor], list[torch.Tensor]], f: float) -> None:
        """Each tensor += f * its piece of the work buffer (converted to its dtype): one foreach call for the
        contiguous float32 tensors, then the others one by one."""
        fast, slow = pieces
        if fast:
            torch._foreach_add_(self._fast_targets, fast, alpha=f)
        for view, i in zip(slow, self._slow, strict=True):
            tensor = self._tensors[i]
            tensor.add_(view.to(tensor.dtype), alpha=f)

    def statistics(self) -> list[tuple[int, int]]:
        ends = np.cumsum(self._sizes).tolist()
        return [(end - size, end) for end, size in zip(ends, self._sizes, strict=True)][self._first_stat :]

    def allocate(self, size: int, dtype: np.dtype) -> np.ndarray:
        if self.device.type == "cuda":  # pinned, so device-to-host copies run at full speed
            nbytes = size * np.dtype(dtype).itemsize
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy().view(dtype)
        return super().allocate(size, dtype)

    @torch.no_grad()
    def copy_to(self, out: np.ndarray, wire: str = "float32") -> None:
        host = kernels.as_torch(out, wire)
        if self.device.type == "cuda" and self._chunks is not None:
            self._copy_chunked(host, wire)
        elif self.device.type == "cuda":
            flat = self._buffer("device", wire)
            self._gather(flat)  # converted on the device, so half-precision wires copy half the bytes
            host.copy_(flat)
        else:
            self._gather(host)

    def _float32_source(self, peer: np.ndarray, wire: str, slot: str) -> torch.Tensor:
        """`peer` as a flat float32 tensor on the model's device (a view when no conversion is needed)."""
        source = kernels.as_torch(kernels.aligned(peer), wire)
        if self.device.type == "cuda":
            staging = self._buffer("pinned", wire)
            staging.copy_(source)
            flat = self._buffer(slot, "float32")
            flat.copy_(staging)  # converted to float32 on the device
            return flat
        if wire != "float32":
            return self._buffer(slot, "float32").copy_(source)
        return source

    @torch.no_grad()
    def lerp_from(self, peer: np.ndarray, f: float, wire: str = "float32") -> None:
        """x += f (peer - x), computed flat in float32 (torch's lerp: exact at f = 0 and f = 1)."""
        if self._chunks is not None:
            self._blend_chunked(peer, None, f, wire)
            return
        source = self._float32_source(peer, wire, "device")
        work, fast, slow = self._work()
        self._gather(work)
        work.lerp_(source, float(f))
        if fast:
            torch._foreach_copy_(self._fast_targets, fast)
        for view, i in zip(slow, self._slow, strict=True):
            self._tensors[i].copy_(view)  # converted to the tensor's dtype and layout

    @torch.no_grad()
    def within(self, bound: float) -> bool:
        """Every tensor's largest magnitude, in one foreach call: NaN anywhere makes it NaN, which fails."""
        largest = torch._foreach_norm(self._tensors, math.inf)
        return bool(torch.stack([n.float() for n in largest]).max() <= bound)

    @torch.no_grad()
    def add_to_parameters(self, v: np.ndarray, w: float = 1.0) -> None:
        """Each parameter tensor += w times its piece of `v` (in the tensor's dtype, on its device); buffers
        (running statistics) untouched. One op per tensor: a rule's own vector, not the hot path."""
        source = torch.from_numpy(checked_vector(v, self.size))
        at = 0
        for tensor, size in zip(self._tensors[: self._first_stat], self._sizes, strict=False):
            piece = source[at : at + size].view(tensor.shape)  # logical order, as copy_to writes it
            tensor.add_(piece.to(device=tensor.device, dtype=tensor.dtype), alpha=float(w))
            at += size

    @torch.no_grad()
    def load_from(self, source: np.ndarray, wire: str = "float32") -> None:
        torch._foreach_zero_(self._tensors)  # lerp at f = 1 from zeros is the source exactly; from a NaN, NaN
        self.lerp_from(source, 1.0, wire)

    @torch.no_grad()
    def add_scaled_diff_from(self, a: np.ndarray, b: np.ndarray, f: float, wire: str = "float32") -> None:
        """Parameters: ``x += f (a - b)``; buffers (running statistics): ``x += f (a - x)``, convex."""
        if self._chunks is not None:
            self._blend_chunked(a, b, f, wire)
            return
        work, fast, slow = self._work()
        if self.device.type == "cpu" and wire == "float32" and self.size < kernels.TORCH_MIN_ELEMENTS:
            # A small model: the same float32 subtractions by numpy (as dpwa.mixing.kernels does below that
            # size), reading both snapshots where they lie: no torch view of a read-only peer buffer (each sets
            # up a warning filter), no view made per call. Larger ones use torch's threads.
            flat, tail, flat_tail = self._work_numpy()
            np.subtract(a, b, out=flat)
            if tail is not None:  # running statistics: towards the peer's snapshot
                self._gather(tail, first=self._first_stat)
                np.subtract(a[self._stats_from :], flat_tail, out=flat_tail)
            self._add((fast, slow), float(f))
            return
        first = self._float32_source(a, wire, "device")  # views, or two distinct work buffers
        second = self._float32_source(b, wire, "device2")
        torch.sub(first, second, out=work)
        if self._stats_from < self.size:  # running statistics: towards the peer's snapshot
            n = self.size - self._stats_from
            tail = work.narrow(0, self._stats_from, n)
            self._gather(tail, first=self._first_stat)
            torch.sub(first.narrow(0, self._stats_from, n), tail, out=tail)
        self._add((fast, slow), float(f))

    def _work_numpy(self) -> tuple[np.ndarray, torch.Tensor | None, np.ndarray]:
        """(CPU) The work buffer as numpy, its running statistics' tail as torch (None without any) and as
        numpy: views made once."""
        if self._work_np is None:
            work = self._work()[0]
            tail = work.narrow(0, self._stats_from, self.size - self._stats_from)
            self._work_np = work.numpy(), tail if self._stats_from < self.size else None, tail.numpy()
        return self._work_np


def _chunk_pieces(sizes: list[int], chunk: int) -> list[tuple[int, int, list[tuple[int, int, int, int]]]]:
    """The flat vector of tensors of `sizes` cut into chunks of `chunk` elements: (start, end, pieces) per
    chunk, each piece (tensor index, start and end within that tensor, start within the chunk)."""
    chunks: list[tuple[int, int, list[tuple[int, int, int, int]]]] = []
    total = sum(sizes)
    offsets = np.cumsum([0, *sizes]).tolist()
    index = 0
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        pieces = []
        while index < len(sizes) and offsets[index] < end:
            lo, hi = max(start, offsets[index]), min(end, offsets[index + 1])
            if hi > lo:
                pieces.append((index, lo - offsets[index], hi - offsets[index], lo - start))
            if offsets[index + 1] <= end:
                index += 1
            else:
                break
        chunks.append((start, end, pieces))
    return chunks


_TENSOR_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


_SCALAR_DEVICE = "cpu"  # where torch keeps an optimizer's scalar state ("step"), whatever the parameters' device
EXTRA_MARGIN_BYTES = 64 << 10  # a donor's optimizer state may exceed the size of ours by this much at most


@dataclass(frozen=True)
class _Slot:
    """What one entry of our optimizer's state holds once it has stepped: a tensor's layout, or a number."""

    kind: str  # "tensor" | "value"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    on_param_device: bool = True  # a tensor follows its parameter's device (else it lives on the CPU)


class OptimizerState:
    """An optimizer's state (momentum buffers, step counts) as msgpack metadata plus raw tensor bytes.

    What a joining node takes from its donor besides the parameters (see
    :mod:`dpwa.gossip.transfer.join`). Never pickle: the metadata holds only numbers,
    names and tensor layouts. A donor's state is checked against what our own
    optimizer's state looks like once it has stepped (learned from a probe of
    the same class and parameter groups on the ``meta`` device: no memory,
    no change to ours): the same parameters, the same keys, each tensor of
    the same shape and dtype, every value finite and within the bounds
    peers' parameters get (:data:`~dpwa.gossip.transfer.protocol.MAX_VALUE`), numbers
    of the same type. Tensors go to the device ours would live on.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._layout: dict[int, dict[str, _Slot]] | None = None
        self._probe_error = ""

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def layout(self) -> dict[int, dict[str, _Slot]]:
        """Our state's layout once stepped (parameter index -> key -> slot); ValueError if it cannot be known."""
        if self._layout is None and not self._probe_error:
            try:
                self._layout = _probe_layout(self.optimizer)
            except Exception as exc:  # a custom optimizer whose class cannot be rebuilt, or stepped, on meta
                self._probe_error = f"{type(exc).__name__}: {exc}"[:200]
        if self._layout is None:
            raise ValueError(
                f"cannot tell what a {type(self.optimizer).__name__}'s state looks like ({self._probe_error}), "
                "so no donor's state can be checked"
            )
        return self._layout

    def budget(self) -> int:
        """The most bytes of optimizer state this node takes from a donor: ours once stepped, plus a margin."""
        try:
            layout = self.layout()
        except ValueError:
            return 0
        element = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in _TENSOR_DTYPES.items()}
        ours = sum(
            math.prod(slot.shape) * element[slot.dtype]
            for entry in layout.values()
            for slot in entry.values()
            if slot.kind == "tensor"
        )
        return ours + EXTRA_MARGIN_BYTES

    @torch.no_grad()
    def capture(self) -> tuple[bytes, np.ndarray]:
        state = self.optimizer.state_dict()["state"]
        parts: list[np.ndarray] = []
        meta: dict[str, dict[str, list[Any]]] = {}
        offset = 0
        for index, entry in state.items():
            described: dict[str, list[Any]] = {}
            for key, value in entry.items():
                if torch.is_tensor(value):
                    host = value.detach().to("cpu").contiguous()
                    dtype = str(host.dtype).replace("torch.", "")
                    if dtype not in _TENSOR_DTYPES:
                        raise ValueError(f"optimizer state {key!r} has dtype {dtype}, which a joiner cannot take")
                    raw = host.view(-1).view(torch.uint8).numpy() if host.numel() else np.empty(0, np.uint8)
                    described[key] = ["tensor", offset, list(host.shape), dtype]
                    parts.append(raw)
                    offset += raw.nbytes
                elif value is None or isinstance(value, (bool, int, float)):
                    described[key] = ["value", value]
                else:
                    raise ValueError(f"optimizer state {key!r} is a {type(value).__name__}, which a joiner cannot take")
            meta[str(index)] = described
        data = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        return msgpack.packb({"state": meta, "bytes": offset}, use_bin_type=True), data

    @torch.no_grad()
    def check(self, meta: bytes, data: np.ndarray) -> dict[int, dict[str, Any]]:
        """A donor's state, checked field by field against ours; ValueError naming the field at fault.

        Returns the state as our optimizer's ``state_dict()["state"]`` holds it (tensors still on the
        CPU, copied out of `data`), for :meth:`load`.
        """
        try:
            decoded = msgpack.unpackb(meta, raw=False, strict_map_key=False, max_str_len=256, max_array_len=64)
        except Exception as exc:
            raise ValueError(f"unreadable optimizer metadata: {type(exc).__name__}") from None
        if (
            not isinstance(decoded, dict)
            or decoded.get("bytes") != data.nbytes
            or not isinstance(decoded.get("state"), dict)
        ):
            raise ValueError("the optimizer metadata does not describe the bytes received")
        layout = self.layout()
        params = self._params()
        state: dict[int, dict[str, Any]] = {}
        for index_text, entry in decoded["state"].items():
            if not (isinstance(index_text, str) and index_text.isdigit() and int(index_text) < len(params)):
                raise ValueError(f"optimizer state for parameter {index_text!r:.40}, we have {len(params)}")
            if not isinstance(entry, dict):
                raise ValueError(f"optimizer state of parameter {index_text}: entries must be maps")
            index = int(index_text)
            ours = layout.get(index, {})
            if set(entry) != set(ours):
                raise ValueError(
                    f"optimizer state of parameter {index}: keys {sorted(map(str, entry))[:8]}, ours are {sorted(ours)}"
                )
            state[index] = {
                key: _checked_value(f"parameter {index} {key!r}", spec, ours[key], data) for key, spec in entry.items()
            }
        return state

    @torch.no_grad()
    def load(self, state: dict[int, dict[str, Any]]) -> None:
        """Take over a state :meth:`check` returned (tensors go to the device ours would live on)."""
        params = self._params()
        layout = self.layout()
        placed = {
            index: {
                key: value.to(params[index].device if layout[index][key].on_param_device else _SCALAR_DEVICE)
                if torch.is_tensor(value)
                else value
                for key, value in entry.items()
            }
            for index, entry in state.items()
        }
        ours = self.optimizer.state_dict()
        self.optimizer.load_state_dict({"state": placed, "param_groups": ours["param_groups"]})

    def restore(self, meta: bytes, data: np.ndarray) -> None:
        """Check a donor's state and take it over; ValueError (and nothing changed) if it does not fit."""
        self.load(self.check(meta, data))


def _probe_layout(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, _Slot]]:
    """Step a copy of `optimizer` (same class, same groups) once over zero-sized-in-memory ``meta`` tensors."""
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [torch.zeros_like(p, device="meta", requires_grad=True) for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    probe = type(optimizer)(groups)  # type: ignore[call-arg]  # every torch optimizer takes its groups first
    for group in probe.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    probe.step()
    layout: dict[int, dict[str, _Slot]] = {}
    for index, entry in probe.state_dict()["state"].items():
        slots = {}
        for key, value in entry.items():
            if torch.is_tensor(value):
                dtype = str(value.dtype).replace("torch.", "")
                slots[key] = _Slot("tensor", tuple(value.shape), dtype, on_param_device=value.device.type == "meta")
            else:
                slots[key] = _Slot("value", dtype=type(value).__name__)
        layout[int(index)] = slots
    return layout


def _checked_value(where: str, spec: Any, slot: _Slot, data: np.ndarray) -> Any:
    """One state value from its description, checked against our slot."""
    if not (isinstance(spec, list) and spec and spec[0] in ("tensor", "value")):
        raise ValueError(f"optimizer state {where}: a bad description {spec!r:.80}")
    if spec[0] != slot.kind:
        raise ValueError(f"optimizer state {where}: a {spec[0]}, ours is a {slot.kind}")
    if slot.kind == "value":
        value = spec[1] if len(spec) == 2 else None
        if type(value).__name__ != slot.dtype or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"optimizer state {where}: {value!r:.40}, ours is a finite {slot.dtype}")
        return value
    if len(spec) != 4:
        raise ValueError(f"optimizer state {where}: a bad tensor description {spec!r:.80}")
    _, offset, shape, dtype = spec
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"optimizer state {where}: a bad shape {shape!r:.80}")
    if tuple(shape) != slot.shape or dtype != slot.dtype:
        raise ValueError(
            f"optimizer state {where}: shape {list(shape)} {dtype!r:.20}, ours is {list(slot.shape)} {slot.dtype}"
        )
    torch_dtype = _TENSOR_DTYPES[dtype]
    nbytes = math.prod(shape) * torch.empty(0, dtype=torch_dtype).element_size()
    if not (isinstance(offset, int) and 0 <= offset <= data.nbytes - nbytes):
        raise ValueError(
            f"optimizer state {where}: {nbytes} bytes at {offset!r:.20} lie outside the {data.nbytes} received"
        )
    tensor = torch.from_numpy(data[offset : offset + nbytes].copy()).view(torch_dtype).reshape(shape)
    if tensor.numel() and tensor.is_floating_point():
        finite = bool(torch.isfinite(tensor).all())
        if not finite or float(tensor.abs().max()) > MAX_VALUE:
            raise ValueError(f"optimizer state {where}: values that are NaN, Inf or beyond ±{MAX_VALUE:g}")
    elif tensor.numel() and int(tensor.abs().max()) > MAX_VALUE:
        raise ValueError(f"optimizer state {where}: integers beyond ±{MAX_VALUE:g}")
    return tensor


class DpwaPyTorchAdapter:
    """Gossip averaging for a PyTorch model.

    Args:
        net: the model; its parameters are blended in place.
        name: which node of the configuration this process is (None with ``nodes: torchrun``:
            the worker's ``rank<RANK>``).
        config_file: a YAML path, or a :class:`~dpwa.config.Config`, or parsed YAML data; None (the default):
            ``$DPWA_CONFIG``, or under torchrun the torchrun defaults (:data:`~dpwa.adapters.hook.TORCHRUN_DEFAULTS`).
        include_buffers: also blend floating-point buffers such as BatchNorm
            running statistics (default True).
        rng: seed the decisions to start an exchange and the peer choice (tests, reproducibility).
        optimizer: give it, and a node that joins a running cluster takes
            its donor's optimizer state (momentum) too, not only the parameters.
        outer_optimizer: an outer step by any ``torch.optim.Optimizer``: a callable that takes
            the anchor tensors (a copy of each parameter) and returns an optimizer over them, e.g.
            ``lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)``. After
            each blend of an exchange this node started, each anchor's ``.grad`` is set to
            ``anchor - parameter``, the optimizer steps, and the parameters become the anchors
            (:class:`~dpwa.adapters.outer.TorchOuter`: parameters only; its state is not carried by
            joins nor by :meth:`outer_state`). ValueError if the config also sets ``outer:``.
    """

    def __init__(
        self,
        net: nn.Module,
        name: str | None,
        config_file: str | os.PathLike[str] | Config | Mapping[str, Any] | list | None = None,
        *,
        include_buffers: bool = True,
        rng: random.Random | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        outer_optimizer: OuterOptimizerFactory | None = None,
    ) -> None:
        if config_file is None:  # as gossip_optimizer and the callbacks find theirs
            from .hook import node_from_env

            config_file = node_from_env(None, name).config
        self.net = net
        self.params = TorchParams(net, include_buffers=include_buffers)
        extra = OptimizerState(optimizer) if optimizer is not None else None
        outer = None
        if outer_optimizer is not None:
            config = config_file = as_config(config_file)  # parsed once, here: the node takes it as it is
            if config.outer != "none":
                raise ValueError(
                    f"{config.source}: outer_optimizer and outer: {config.outer} both set an outer step; "
                    "give one (outer: none with outer_optimizer)"
                )
            outer = TorchOuter(net, outer_optimizer)
        #: the outer optimizer ``outer_optimizer`` made (None without one): for an lr schedule, or its state_dict
        self.outer_optimizer = outer.optimizer if outer is not None else None
        self.node = Node(config_file, name, self.params, rng=rng, extra=extra, outer=outer)

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def clock(self) -> float:
        return self.node.clock

    @property
    def rank(self) -> int:
        """This node's index in the config's node list (under torchrun: RANK). See Node.rank."""
        return self.node.rank

    @property
    def world_size(self) -> int:
        """The number of nodes in the config's node list (under torchrun: WORLD_SIZE). See Node.world_size."""
        return self.node.world_size

    def update_send(self, loss: Any = None, batch_size: float = 1) -> bool:
        """Publish parameters, clock and loss before a batch; maybe start an exchange. See Node.update_send."""
        return self.node.update_send(loss, batch_size)

    def update_wait(self, loss: Any = None) -> Update:
        """Blend in the peer's parameters after a batch, if an exchange succeeded. See Node.update_wait."""
        return self.node.update_wait(loss)

    def barrier(
        self,
        name: str = "epoch",
        timeout_s: float | None = None,
        missing: str = "raise",
        stop: Callable[[], bool] = lambda: False,
    ) -> list[str]:
        """Wait until every node has made as many calls of barrier `name`. See Node.barrier."""
        return self.node.barrier(name, timeout_s, missing, stop)

    def start_together(self, timeout_s: float = START_WAIT_S) -> list[str]:
        """Wait for the other nodes at the ``start`` barrier before the first step (at most `timeout_s`; then go on
        without the missing ones, named in the log and returned), as torchrun's rendezvous starts its workers
        together, so that the node whose imports finish first does not train alone. The callbacks and
        ``gossip_optimizer`` call it under dpwa's launcher. A node that joined a running cluster, or resumed
        with barrier counts, passed it already: it returns at once."""
        if self.barrier_counters().get(START_BARRIER, 0):
            return []
        started = time.monotonic()
        skipped = self.barrier(START_BARRIER, timeout_s=timeout_s, missing="proceed")
        waited = time.monotonic() - started
        if skipped:
            logger.warning("%s: started without %s, which did not start within %.0f s", self.name,
                           ", ".join(skipped), timeout_s)  # fmt: skip
        else:
            logger.info("%s: started together with its peers (waited %.1f s for them)", self.name, waited)
        return skipped

    def linger(self, idle_s: float, limit_s: float, stop: Callable[[], bool] = lambda: False) -> float:
        """Keep serving peers without training until none is served for `idle_s`. See Node.linger."""
        return self.node.linger(idle_s, limit_s, stop)

    def stats(self) -> dict[str, Any]:
        return self.node.stats()

    def barrier_counters(self) -> dict[str, int]:
        return self.node.barrier_counters()

    def outer_state(self) -> dict[str, Any] | None:
        """For a checkpoint: the outer step's anchor and momentum (CPU tensors) and step count; None
        with ``outer: none`` (with ``outer_optimizer`` too: see :class:`~dpwa.adapters.outer.TorchOuter`).
        See Node.outer_state."""
        state = self.node.outer_state()
        if state is None:
            return None
        return {**state, "anchor": torch.from_numpy(state["anchor"]), "buf": torch.from_numpy(state["buf"])}

    def rule_state(self) -> dict[str, Any] | None:
        """For a checkpoint: the mixing rule's per-node state (numbers, strings, lists and maps; None when
        the rule keeps none: every built-in rule but ``clipped`` with ``radius: auto``). See Node.rule_state."""
        return self.node.rule_state()

    def restore(
        self,
        clock: float | None = None,
        barriers: Mapping[str, int] | None = None,
        outer: Mapping[str, Any] | None = None,
        rule: Mapping[str, Any] | None = None,
    ) -> None:
        """Resume from a checkpoint, after loading the model's weights: the clock, barrier counters,
        the outer step's state (:meth:`outer_state`'s; ``outer_optimizer``'s starts afresh from the
        loaded weights: load its ``state_dict`` after this to keep its momentum) and the mixing rule's
        (:meth:`rule_state`'s). See Node.restore."""
        if isinstance(outer, Mapping):  # anything else: the node refuses it, saying what it got
            outer = {k: _numpy(f"a checkpoint's outer state: {k!r:.40}", v) for k, v in outer.items()}
        self.node.restore(clock, barriers, outer, rule)

    def checkpoint(self) -> dict[str, Any]:
        """What a checkpoint keeps of the node, beside the model and the optimizer: its clock, barrier counters,
        the outer step's state and the mixing rule's (tensors, numbers and strings only: ``torch.save`` it with
        them, and load it with ``weights_only=True``). :meth:`restore_checkpoint` takes it back."""
        return {
            "clock": self.clock,
            "barriers": self.barrier_counters(),
            "outer": self.outer_state(),
            "rule": self.rule_state(),
        }

    def restore_checkpoint(self, saved: Mapping[str, Any]) -> None:
        """Resume from what :meth:`checkpoint` gave, after loading the model's weights (and its optimizer's state).
        A checkpoint that has no ``rule`` (written before rule states were kept) leaves the rule's state as it is;
        anything else that does not fit is refused, saying what (see :meth:`restore`)."""
        if not isinstance(saved, Mapping):
            raise ValueError(f"a node checkpoint must be a mapping (from checkpoint()), got {type(saved).__name__}")
        self.restore(
            clock=saved.get("clock"), barriers=saved.get("barriers"), outer=saved.get("outer"), rule=saved.get("rule")
        )

    def join(self, wait_s: float = 60.0) -> bool:
        """Take a trained peer's state now (parameters, optimizer state, clock, barriers). See Node.join."""
        return self.node.join(wait_s)

    @property
    def joined(self) -> Any:
        """The state this node took from a peer at start or by :meth:`join` (None if it took none).

        ``joined.rejoined`` is True when the cluster had trained (this node started late, or again), False
        at a fresh start (it took the first node's initial parameters, at clock 0). See Node.joined.
        """
        return self.node.joined

    def close(self) -> None:
        self.node.close()

    def __enter__(self) -> DpwaPyTorchAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _numpy(where: str, value: Any) -> Any:
    """A tensor as a numpy array (its dtype kept, for the node to check); anything else as it is."""
    if not torch.is_tensor(value):
        return value
    try:
        return value.detach().cpu().numpy()
    except (TypeError, RuntimeError) as exc:  # a dtype numpy has not (bfloat16), a tensor that needs grad
        raise ValueError(f"{where}: {exc}") from None
