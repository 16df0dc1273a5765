"""DiLoCo: local steps, then an all-reduce of the pseudo-gradient and an outer Nesterov step, over gloo.

Douillard et al. 2023 ("DiLoCo: Distributed Low-Communication Training of
Language Models", arXiv 2311.08105). Every worker takes H steps of its own
(inner) optimizer on its own data; then the workers all-reduce the
*pseudo-gradient*, the anchor (the parameters every worker shared after the
last synchronisation) minus their parameters now, and each takes the same
outer step on the anchor with the mean (:mod:`dpwa.mixing.outer`: Nesterov
momentum; the paper's outer learning rate 0.7 and momentum 0.9). Every worker
then continues from the new anchor; its inner optimizer keeps its state.
Floating-point buffers (BatchNorm running statistics) are averaged at the same
all-reduce. Workers communicate once every H steps, so they move 1/H of what
all-reduce moves per step; in between they do not wait for each other.

It runs over ``torch.distributed`` with gloo, like :mod:`.allreduce`: join the
group first (:func:`.allreduce.join_group`, or :func:`.allreduce.launch`).

Example (in every rank)::

    net = build_model()                     # the same initial weights on every rank
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    diloco = DiLoCo(net, period=10)         # outer lr 0.7, momentum 0.9
    for x, y in batches:
        loss_fn(net(x), y).backward()
        opt.step(); opt.zero_grad()
        diloco.step()                       # every 10th call: all-reduce and the outer step
    diloco.sync()                           # the last partial period, so every rank ends equal
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dpwa.mixing.outer import OuterNesterov, OuterSettings, pseudo_gradient

from .allreduce import CommTimer, ring_allreduce_bytes, timed_allreduce
from .layout import ModuleView, check_values

__all__ = ["DEFAULT_PERIOD", "DiLoCo"]

DEFAULT_PERIOD = 10  # inner steps between two synchronisations (see docs/comparison.md, "DiLoCo", for why)


class DiLoCo:
    """The outer loop of one rank: counts inner steps, synchronises every `period`.

    Args:
        module: the model; its parameters are replaced in place at each
            synchronisation (their storage is kept, so the inner optimizer
            keeps working). Every rank must start from the same weights.
        period: H, inner steps between two synchronisations.
        settings: the outer optimizer's (default: lr 0.7, Nesterov momentum 0.9).
        timer: where the all-reduce's time, calls and bytes are counted.
    """

    def __init__(
        self,
        module: nn.Module,
        period: int = DEFAULT_PERIOD,
        settings: OuterSettings | None = None,
        timer: CommTimer | None = None,
    ) -> None:
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be a positive integer, got {period!r}")
        self.view = ModuleView(module)
        self.period = period
        self.timer = timer or CommTimer()
        layout = self.view.layout
        self.outer = OuterNesterov(layout.param_size, settings)
        self.anchor = self.view.params()  # the shared parameters of the last synchronisation
        self._local = np.empty_like(self.anchor)
        # one flat vector per synchronisation: the pseudo-gradient, then the buffers
        self._message = torch.zeros(layout.param_size + layout.buffer_size, dtype=torch.float32)
        self._gpu_message: torch.Tensor | None = None  # its copy on the GPU, made at the first sync over NCCL
        self.inner_steps = 0  # since the last synchronisation
        self.syncs = 0

    @property
    def bytes_per_sync(self) -> float:
        """Bytes one rank sends plus receives per synchronisation, in a ring all-reduce."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        return ring_allreduce_bytes(4 * self._message.numel(), world)

    def step(self) -> bool:
        """Count one inner step (after the inner optimizer's); synchronise every `period`. True if it did."""
        self.inner_steps += 1
        if self.inner_steps < self.period:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """All-reduce the pseudo-gradient and the buffers, take the outer step, load the new anchor.

        Every rank must call it the same number of times (a collective).
        Raises ValueError, on every rank alike, if the mean holds NaN, Inf or
        a value beyond ±1e12 (a diverged worker): nothing is loaded then.
        """
        layout = self.view.layout
        message = self._message.numpy()
        pseudo_gradient(self.anchor, self.view.params(self._local), out=message[: layout.param_size])
        if layout.buffer_size:
            self.view.buffers(message[layout.param_size :])
        if dist.is_initialized() and dist.get_backend() == "nccl":  # NCCL reduces only tensors on the GPU
            if self._gpu_message is None:
                self._gpu_message = torch.empty_like(self._message, device=torch.cuda.current_device())
            self._gpu_message.copy_(self._message)
            timed_allreduce(self._gpu_message, self.timer)
            self._message.copy_(self._gpu_message)
        else:
            timed_allreduce(self._message, self.timer)
        check_values(message, f"DiLoCo synchronisation {self.syncs + 1}: the mean pseudo-gradient and buffers")
        self.outer.step(self.anchor, message[: layout.param_size])
        self.view.load_params(self.anchor)
        if layout.buffer_size:
            self.view.load_buffers(message[layout.param_size :])
        self.inner_steps = 0
        self.syncs += 1
