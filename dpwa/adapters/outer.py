"""An outer step by any ``torch.optim.Optimizer``: the PyTorch adapter's ``outer_optimizer``.

The named outer steps (``outer: nesterov``, ``outer: noloco``; see
:mod:`dpwa.gossip.exchange.outer`) are two fixed rules over flat float32 arrays. As
torchft's DiLoCo does, the adapter also takes any optimizer over the
pseudo-gradient::

    conn = DpwaPyTorchAdapter(
        net, "w1", "cluster.yaml",
        outer_optimizer=lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True),
    )

:class:`TorchOuter` keeps an *anchor*: a copy of each of the model's
parameters (same shape, dtype and device), taken at the start. The factory
gets those copies and returns the optimizer over them. After each blend of
an exchange the node started (where the named outer step is taken), it sets
each anchor's ``.grad`` to the pseudo-gradient ``anchor - parameter``, calls
``optimizer.step()``, and copies the anchors into the parameters: training
continues from the new anchor. With the factory above the step is exactly
``outer: nesterov`` with ``outer_lr: 0.7``, ``outer_momentum: 0.9``
(:func:`dpwa.mixing.outer.nesterov_step` is torch's rule for SGD with
``nesterov=True`` and no dampening or weight decay, and its buffer, starting at
zero, holds the first gradient after one step as torch's does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["OuterOptimizerFactory", "TorchOuter"]

# what outer_optimizer is: the anchors in, an optimizer over them out
OuterOptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class TorchOuter:
    """A node's outer step by a user's optimizer over the pseudo-gradient (training thread).

    The node calls :meth:`apply` after each blend of an exchange it started, and :meth:`reanchor`
    when its parameters were replaced otherwise (a join, a restore from a checkpoint).

    * **Parameters only.** Buffers (BatchNorm's running statistics) take no outer step: they stay
      where averaging put them, as with the named outer steps. A parameter the optimizer does not
      hold (the factory may leave some out, frozen ones say) takes none either: it stays where
      averaging put it, and its anchor follows it.
    * **Joins do not carry its state.** A joiner takes its donor's parameters (and the inner
      optimizer's state, given ``optimizer=``), never the outer optimizer's: it starts that afresh
      from the joined parameters (the anchor a copy of them; ``optimizer.state`` emptied, so momentum
      and step counts begin again). The named outer steps travel with a join; this one cannot be
      checked against a donor's the same way, whatever optimizer it is.
    * **Checkpoints.** ``outer_state()`` is None with ``outer_optimizer``. ``restore()`` starts the
      outer optimizer afresh from the loaded parameters, as a join does; to keep its momentum across
      a checkpoint, save ``conn.outer_optimizer.state_dict()`` and load it after ``restore()``.

    Memory: the anchor (one copy of the parameters), its ``.grad`` (another) and the optimizer's state.

    Args:
        net: the model whose parameters take the outer step.
        make_optimizer: called once with the anchors (in ``net.parameters()`` order); returns a
            ``torch.optim.Optimizer`` over some or all of them, and nothing else.
    """

    def __init__(self, net: nn.Module, make_optimizer: OuterOptimizerFactory) -> None:
        if not callable(make_optimizer):
            raise TypeError(
                "outer_optimizer must be a callable that takes the anchor tensors and returns an optimizer, "
                f"got {type(make_optimizer).__name__}"
            )
        params = list(net.parameters())
        if not params:
            raise ValueError(f"{type(net).__name__} has no parameters for an outer step")
        self._params = [p.detach() for p in params]  # same storage as the model's
        with torch.no_grad():  # leaves, each as the model's parameter requires grad (a factory may filter on it)
            self.anchor = [p.detach().clone().requires_grad_(p.requires_grad) for p in params]
        optimizer = make_optimizer(iter(self.anchor))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        ours = {id(a): i for i, a in enumerate(self.anchor)}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) not in ours for p in held):
            raise ValueError(
                "outer_optimizer's optimizer holds tensors it was not given: build it over the tensors the "
                "callable receives (the anchors), not over the model's parameters"
            )
        stepped = {ours[id(p)] for p in held}
        if not stepped:
            raise ValueError("outer_optimizer's optimizer holds none of the tensors it was given")
        self.optimizer = optimizer
        self._stepped = [i in stepped for i in range(len(self.anchor))]

    @torch.no_grad()
    def apply(self) -> None:
        """After a blend: ``anchor.grad = anchor - parameter``, one ``optimizer.step()``, and the
        parameters become the new anchor (a parameter the optimizer does not hold: the anchor follows it)."""
        for anchor, param in zip(self.anchor, self._params, strict=True):
            if anchor.grad is None:
                anchor.grad = torch.empty_like(anchor)
            torch.sub(anchor, param, out=anchor.grad)
        self.optimizer.step()
        for anchor, param, stepped in zip(self.anchor, self._params, self._stepped, strict=True):
            if stepped:
                param.copy_(anchor)
            else:
                anchor.copy_(param)

    @torch.no_grad()
    def reanchor(self) -> None:
        """The parameters were replaced (a join, a restore): the anchor becomes a copy of them and the
        optimizer's per-parameter state is emptied, so it starts afresh."""
        for anchor, param in zip(self.anchor, self._params, strict=True):
            anchor.copy_(param)
            anchor.grad = None
        self.optimizer.state.clear()
