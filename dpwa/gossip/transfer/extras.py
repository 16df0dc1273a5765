"""Everything a joiner takes besides the parameters, as one :class:`~dpwa.gossip.transfer.join.ExtraState`.

A node may hold several such states: the optimizer's (momentum buffers; the
PyTorch adapter's ``optimizer=``), its outer step's (anchor and momentum;
``outer:``) and its mixing rule's (:class:`RuleState`). :class:`Extras` sends them as one: msgpack metadata that lists
each part's name, its own metadata and its byte count, then the parts'
bytes in that order. A joiner checks the list against its own parts (known
names, each at most once, byte counts that add up to what came and fit each
part's budget) and then each part with that part's own check. A part the
donor does not have is left as the joiner's own.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from ...mixing.rules import Rule
from .join import MAX_EXTRA_META, ExtraState

__all__ = ["Extras", "MAX_RULE_STATE_BYTES", "RuleState"]

MAX_RULE_STATE_BYTES = 64 * 1024  # a mixing rule's state a joiner takes


class Extras:
    """Named extra states as one ExtraState (see the module).

    Args:
        parts: name -> state; the names are what travels.
    """

    def __init__(self, parts: dict[str, ExtraState]) -> None:
        if not parts:
            raise ValueError("Extras needs at least one part")
        self.parts = dict(parts)

    @classmethod
    def of(cls, **parts: ExtraState | None) -> Extras | None:
        """The parts that are not None, as one (None when there are none)."""
        present = {name: part for name, part in parts.items() if part is not None}
        return cls(present) if present else None

    def capture(self) -> tuple[bytes, np.ndarray]:
        listed, blobs = [], []
        for name, part in self.parts.items():
            meta, data = part.capture()
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            listed.append([name, meta, int(data.nbytes)])
            blobs.append(data)
        return msgpack.packb(listed, use_bin_type=True), np.concatenate(blobs)

    def budget(self) -> int:
        return sum(part.budget() for part in self.parts.values())

    def check(self, meta: bytes, data: np.ndarray) -> dict[str, Any]:
        """Each part the donor sent, checked by our part of that name; ValueError naming what does not fit."""
        try:
            listed = msgpack.unpackb(
                meta, raw=False, max_array_len=max(3, len(self.parts)), max_str_len=64, max_bin_len=MAX_EXTRA_META
            )
        except Exception as exc:  # any malformed msgpack, in words
            raise ValueError(f"extra state: metadata is not msgpack ({exc.__class__.__name__})") from None
        if not isinstance(listed, list) or len(listed) > len(self.parts):
            raise ValueError(f"extra state: expected a list of at most {len(self.parts)} parts")
        checked: dict[str, Any] = {}
        offset = 0
        for entry in listed:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise ValueError("extra state: each part is [name, metadata, bytes]")
            name, part_meta, nbytes = entry
            if name not in self.parts or name in checked:
                raise ValueError(
                    f"extra state: part {name!r:.40} is unknown or repeated; ours are {sorted(self.parts)}"
                )
            part = self.parts[name]
            if not isinstance(part_meta, bytes) or not isinstance(nbytes, int) or isinstance(nbytes, bool):
                raise ValueError(f"extra state: part {name!r} has malformed metadata or size")
            if not 0 <= nbytes <= part.budget() or offset + nbytes > data.nbytes:
                raise ValueError(f"extra state: part {name!r} claims {nbytes} bytes; we take at most {part.budget()}")
            checked[name] = part.check(part_meta, data[offset : offset + nbytes])
            offset += nbytes
        if offset != data.nbytes:
            raise ValueError(f"extra state: the parts hold {offset} bytes, {data.nbytes} came")
        return checked

    def load(self, checked: dict[str, Any]) -> None:
        for name, state in checked.items():
            self.parts[name].load(state)


class RuleState:
    """A mixing rule's per-node state (:meth:`dpwa.mixing.rules.Rule.state`) as an ExtraState: the state in
    msgpack as its bytes (at most :data:`MAX_RULE_STATE_BYTES`), checked by the rule itself
    (:meth:`~dpwa.mixing.rules.Rule.check_state`) before anything is taken."""

    def __init__(self, rule: Rule) -> None:
        self._rule = rule

    @classmethod
    def of(cls, rule: Rule) -> RuleState | None:
        """One for `rule` if it keeps state a joiner takes, else None."""
        return cls(rule) if rule.state() else None

    def capture(self) -> tuple[bytes, np.ndarray]:
        return b"", self._packed(self._rule.state(), f"rule {self._rule.name!r}")

    def _packed(self, state: Any, source: str) -> np.ndarray:
        """`state` as the bytes a donor sends: msgpack, at most :data:`MAX_RULE_STATE_BYTES`."""
        try:
            packed = msgpack.packb(state, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:  # a type msgpack has no form for, nesting too deep
            raise ValueError(
                f"{source}: not plain numbers, strings, lists and maps ({exc.__class__.__name__})"
            ) from None
        if len(packed) > MAX_RULE_STATE_BYTES:
            raise ValueError(f"{source}: its state is {len(packed)} bytes, at most {MAX_RULE_STATE_BYTES}")
        return np.frombuffer(packed, np.uint8)

    def budget(self) -> int:
        return MAX_RULE_STATE_BYTES

    def check(self, meta: bytes, data: np.ndarray) -> Any:
        if meta:
            raise ValueError(f"rule state: expected no metadata besides its bytes, got {len(meta)}")
        try:
            state = msgpack.unpackb(
                data.tobytes(), raw=False, max_array_len=4096, max_map_len=64, max_str_len=64, max_bin_len=0
            )
        except Exception as exc:  # any malformed msgpack, in words
            raise ValueError(f"rule state: not msgpack ({exc.__class__.__name__})") from None
        return self._rule.check_state(state)

    def load(self, checked: Any) -> None:
        self._rule.load_state(checked)

    def checked(self, state: Any, source: str) -> Any:
        """A state that came another way than from a donor (a checkpoint's: :meth:`Rule.state` as it was
        saved), checked exactly as a donor's: packed as :meth:`capture` packs it, then :meth:`check`.
        Returns what :meth:`load` takes; a ValueError begins with `source`."""
        data = self._packed(state, source)
        try:
            return self.check(b"", data)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
