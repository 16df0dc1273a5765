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
:class:`~dpwa.gossip.join.ExtraState`: checked on arrival like the
optimizer's) and what a checkpoint keeps (:meth:`state`, :meth:`restore`).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from ..config import Config
from ..mixing.outer import GossipOuter, OuterSettings
from ..mixing.params import FlatParams
from .protocol import MAX_VALUE

__all__ = ["OuterStep"]

_MAX_STEPS = 1 << 53  # an outer step count a peer may claim


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
        """For a checkpoint: ``anchor`` and ``buf`` (float32 arrays, copies) and ``steps``."""
        return self.outer.state()

    def restore(self, state: Any) -> None:
        """Continue from :meth:`state`'s output (checked: sizes, dtype, finite values; nothing taken if not)."""
        if not isinstance(state, dict):
            raise ValueError(f"outer state must be a dict of anchor, buf and steps, got {type(state).__name__}")
        self.outer.load_state(state)

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
        """A donor's outer state against ours: the same rule and size, a step count, finite bounded values."""
        try:
            fields = msgpack.unpackb(meta, raw=False, max_str_len=16, max_array_len=0, max_map_len=3)
        except Exception as exc:  # any malformed msgpack, in words
            raise ValueError(f"outer state: metadata is not msgpack ({exc.__class__.__name__})") from None
        if not isinstance(fields, dict) or set(fields) != {"rule", "size", "steps"}:
            raise ValueError("outer state: metadata must hold rule, size and steps")
        if fields["rule"] != self.outer.rule:
            raise ValueError(f"outer state: rule {fields['rule']!r:.20}, ours is {self.outer.rule!r}")
        if fields["size"] != self.outer.anchor.size:
            raise ValueError(f"outer state: size {fields['size']!r:.20}, ours is {self.outer.anchor.size}")
        steps = fields["steps"]
        if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= _MAX_STEPS:
            raise ValueError(f"outer state: steps must be a count up to 2^53, got {steps!r:.20}")
        if data.nbytes != self._nbytes():
            raise ValueError(f"outer state: {data.nbytes} bytes, expected {self._nbytes()}")
        values = np.ascontiguousarray(data).view(np.uint8).view(np.float32)
        if not np.isfinite(values).all() or (values.size and float(np.abs(values).max()) > MAX_VALUE):
            raise ValueError(f"outer state: values must be finite and within {MAX_VALUE:g}")
        size = self.outer.anchor.size
        return {"anchor": values[:size].copy(), "buf": values[size:].copy(), "steps": steps}

    def load(self, checked: dict[str, Any]) -> None:
        self.outer.load_state(checked)
