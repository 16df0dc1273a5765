"""A node's outer step: local steps between exchanges, and an outer optimizer on what each exchange brings.

With ``outer: nesterov`` or ``outer: noloco`` a node keeps an *anchor* (its
parameters after its last outer step) and a momentum buffer; after each blend
of an exchange it started itself it takes
:meth:`dpwa.mixing.outer.GossipOuter.apply`: the mixed parameters move the
anchor by the rule, and training continues from the new anchor. In mode
symmetric, the half a node mirrors for a peer takes no outer step of its
own: that change is part of its next pseudo-gradient, so each node takes one
outer step per exchange it starts, as in NoLoCo. With ``period: H`` the node starts an exchange every H steps, so
the outer step sees H local steps at a time, as DiLoCo's does.

:class:`OuterStep` is that state, owned by the training thread. It is also
what a joiner takes with the parameters (it is an
:class:`~dpwa.gossip.transfer.join.ExtraState`: checked on arrival like the
optimizer's) and what a checkpoint keeps (:meth:`state`, :meth:`restore`).

Both ways in are checked by one function, :func:`checked_outer_state`: a
donor's state and a checkpoint's must name this node's rule, hold an anchor
and a momentum buffer of exactly this model's size (flat float32), finite and
within ±1e18 (:data:`~dpwa.gossip.transfer.protocol.MAX_VALUE`, the bound peers'
parameters get), and a step count up to 2^53. A state that fails is refused
with a ``ValueError`` naming where it came from and what is wrong, and
nothing of it is taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from ...config import Config
from ...mixing.outer import GossipOuter, OuterSettings
from ...mixing.params import FlatParams
from ..transfer.protocol import MAX_VALUE

__all__ = ["OuterStep", "checked_outer_state"]

_MAX_STEPS = 1 << 53  # an outer step count a peer (or a checkpoint) may claim
_FIELDS = ("anchor", "buf", "steps")  # what an outer state holds; "rule" too, but a checkpoint may lack it


def checked_outer_state(state: Any, rule: str, size: int, source: str) -> dict[str, Any]:
    """An outer step's state, checked against a node whose rule is `rule` and whose model has `size` values.

    The one check of every way such a state comes in: a donor's (:meth:`OuterStep.check`, after its bytes
    were split) and a checkpoint's (:meth:`OuterStep.restore`). `state` must be a mapping of ``anchor``
    and ``buf`` (flat float32 arrays of `size` values, finite and within ±MAX_VALUE), ``steps`` (an int
    in [0, 2^53]) and, optionally, ``rule`` (`rule`; a checkpoint written before it was recorded has
    none), and nothing else. Returns ``{"anchor", "buf", "steps"}`` (copies); raises ValueError, its
    message beginning with `source` and naming the field, when anything does not fit.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"{source}: must be a mapping of anchor, buf and steps, got {type(state).__name__}")
    keys = list(state)
    unknown = [k for k in keys if k not in (*_FIELDS, "rule")]
    if unknown:
        raise ValueError(f"{source}: unknown fields {', '.join(repr(k)[:40] for k in unknown[:4])}")
    missing = [k for k in _FIELDS if k not in state]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)}; an outer state holds anchor, buf and steps")
    if "rule" in state and state["rule"] != rule:
        raise ValueError(f"{source}: rule {state['rule']!r:.20}, ours is {rule!r}")
    steps = state["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= _MAX_STEPS:
        raise ValueError(f"{source}: steps must be a count up to 2^53, got {steps!r:.20}")
    checked: dict[str, Any] = {"steps": int(steps)}
    for name in ("anchor", "buf"):
        array = state[name]
        if not isinstance(array, np.ndarray) or array.dtype != np.float32 or array.ndim != 1 or array.size != size:
            got = f"{array.dtype} of shape {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
            raise ValueError(f"{source}: {name} must be a flat float32 array of {size} values, got {got}")
        if not np.isfinite(array).all():
            raise ValueError(f"{source}: {name} holds NaN or Inf (values must be finite and within ±{MAX_VALUE:g})")
        if array.size and float(np.abs(array).max()) > MAX_VALUE:
            raise ValueError(
                f"{source}: {name} holds values beyond ±{MAX_VALUE:g} (values must be finite and within it)"
            )
        checked[name] = array.copy()
    return checked


class OuterStep:
    """The node's outer optimizer (training thread), and its state as a joiner or a checkpoint takes it.

    Args:
        rule: ``nesterov`` or ``noloco`` (see :class:`~dpwa.mixing.outer.GossipOuter`).
        params: the node's parameters; the anchor starts as a copy of them.
        settings: the outer learning rate and momentum.
    """

    def __init__(self, rule: str, params: FlatParams, settings: OuterSettings) -> None:
        self._params = params
        anchor = np.empty(params.size, np.float32)
        params.copy_to(anchor, "float32")
        self.outer = GossipOuter(rule, anchor, settings)

    @classmethod
    def of(cls, config: Config, params: FlatParams) -> OuterStep | None:
        """The outer step `config` asks for (None with ``outer: none``)."""
        if config.outer == "none":
            return None
        return cls(config.outer, params, OuterSettings(config.outer_lr, config.outer_momentum))

    def apply(self) -> None:
        """After a blend: one outer step; the parameters become the new anchor."""
        self.outer.apply(self._params)

    def reanchor(self) -> None:
        """The parameters were replaced (a join without outer state, a restore): start afresh from them."""
        self.outer.reanchor(self._params)

    # ----------------------------------------------------------------- checkpoints

    def state(self) -> dict[str, Any]:
        """For a checkpoint: ``rule``, ``anchor`` and ``buf`` (float32 arrays, copies) and ``steps``."""
        return {"rule": self.outer.rule, **self.outer.state()}

    def checked(self, state: Any, source: str = "a checkpoint's outer state") -> dict[str, Any]:
        """`state` (:meth:`state`'s output, from a checkpoint) checked as a donor's is
        (:func:`checked_outer_state`); ValueError if it does not fit. Takes nothing."""
        return checked_outer_state(state, self.outer.rule, self.outer.anchor.size, source)

    def restore(self, state: Any) -> None:
        """Continue from :meth:`state`'s output, checked first (:meth:`checked`): nothing is taken from a bad one."""
        self.load(self.checked(state))

    # ----------------------------------------------------------------- as a joiner takes it (ExtraState)

    def _nbytes(self) -> int:
        return 2 * self.outer.anchor.nbytes

    def capture(self) -> tuple[bytes, np.ndarray]:
        """(metadata, bytes): the rule, size and step count; the anchor's float32 bytes, then the buffer's."""
        meta = msgpack.packb({"rule": self.outer.rule, "size": self.outer.anchor.size, "steps": self.outer.steps})
        return meta, np.concatenate([self.outer.anchor, self.outer.buf]).view(np.uint8)

    def budget(self) -> int:
        return self._nbytes()

    def check(self, meta: bytes, data: np.ndarray) -> dict[str, Any]:
        """A donor's outer state against ours: its framing (msgpack rule, size, steps; the bytes of an anchor
        and a buffer of our size), then :func:`checked_outer_state`, as a checkpoint's."""
        try:
            fields = msgpack.unpackb(meta, raw=False, max_str_len=16, max_array_len=0, max_map_len=3)
        except Exception as exc:  # any malformed msgpack, in words
            raise ValueError(f"outer state: metadata is not msgpack ({exc.__class__.__name__})") from None
        if not isinstance(fields, dict) or set(fields) != {"rule", "size", "steps"}:
            raise ValueError("outer state: metadata must hold rule, size and steps")
        if fields["size"] != self.outer.anchor.size:
            raise ValueError(f"outer state: size {fields['size']!r:.20}, ours is {self.outer.anchor.size}")
        if data.nbytes != self._nbytes():
            raise ValueError(f"outer state: {data.nbytes} bytes, expected {self._nbytes()}")
        values = np.ascontiguousarray(data).view(np.uint8).view(np.float32)
        size = self.outer.anchor.size
        state = {"rule": fields["rule"], "anchor": values[:size], "buf": values[size:], "steps": fields["steps"]}
        return checked_outer_state(state, self.outer.rule, size, "outer state")

    def load(self, checked: dict[str, Any]) -> None:
        self.outer.load_state(checked)
