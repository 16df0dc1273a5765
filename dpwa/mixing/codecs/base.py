"""The wire codec interface: how a snapshot travels between two nodes.

A codec turns the snapshot a node keeps (float32, float16 or bfloat16: its
:attr:`Codec.kept` dtype) into the bytes one reply carries, and those bytes
back into a snapshot on the other side. A codec that sends the kept array as
it is (float32, float16, bfloat16) has no :meth:`Codec.sender` and no
:meth:`Codec.receiver`: the array goes without a copy. A compressing codec
has both:

* the :class:`Sender` encodes a snapshot for one requester, and may add
  fields to the reply's header (which version of a reference it builds on);
* the :class:`Receiver` adds fields to a fetch (what it already holds from
  that peer), and decodes a reply into a float32 buffer, checking every value
  before it writes any: a peer's bytes are never trusted.

Any rule works with any codec: rules see decoded snapshots only. A codec that
needs the requester's identity or history (top-k keeps one reference per
peer) may restrict the modes it runs in (:attr:`Codec.modes`); the config
refuses the others when it loads.

Header fields a codec uses must be declared in :mod:`dpwa.gossip.transfer.protocol`
(``_CODEC_REQUEST`` and ``_CODEC_REPLY``), with their bounds: the schema
checks them before a codec sees them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from ..options import Option, checked

__all__ = ["Codec", "CodecError", "Encoded", "Fields", "Receiver", "Sender"]


class Fields(Protocol):
    """A message header's fields, as a codec reads them (a Mapping, or a decoded wire header)."""

    def get(self, key: str, default: Any = None) -> Any: ...


class CodecError(ValueError):
    """A snapshot a codec cannot decode: `reason` is the refusal's code word (logged and counted), the
    message says which value is wrong and what was expected."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Encoded:
    """One encoded snapshot: the bytes to send, and the header fields that go with them."""

    buffer: np.ndarray  # uint8
    fields: dict[str, Any] = field(default_factory=dict)


class Sender(Protocol):
    """Encodes snapshots as they are sent (thread-safe: the Rx thread serves, the Tx thread exchanges)."""

    def encode(self, values: np.ndarray, peer: str, request: Fields) -> Encoded:
        """`values` (the kept snapshot, float32) encoded for `peer`, whose request header is `request`."""
        ...


class Receiver(Protocol):
    """Decodes what peers send (owned by the thread that reads replies)."""

    def request(self, peer: str) -> dict[str, Any]:
        """Fields to add to a fetch from `peer` (what this node already holds from it)."""
        ...

    def decode(self, raw: np.ndarray, peer: str, reply: Fields, out: np.ndarray, limit: float) -> None:
        """Decode `raw` (uint8) from `peer` into float32 `out`; CodecError, writing nothing to `out`, if any
        value is bad or beyond ±`limit`."""
        ...


class Codec(ABC):
    """How snapshots of `size` values travel. Subclass it, set ``name``, ``summary`` and ``kept``, and
    implement :meth:`max_nbytes`; a compressing codec also implements :meth:`sender` and :meth:`receiver`.

    Args:
        size: values in the model.
        options: the config's ``wire_options``, checked against :attr:`options`.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    kept: ClassVar[str] = "float32"  # the dtype snapshots are kept and blended in
    modes: ClassVar[tuple[str, ...]] = ("symmetric", "pull")  # the config modes it runs in
    options: ClassVar[Mapping[str, Option]] = {}  # its settings under the config's wire_options

    def __init__(self, size: int, options: Mapping[str, Any] | None = None) -> None:
        self.size = size
        self.settings = self.checked_options(options or {})

    @classmethod
    def checked_options(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """`given` checked against :attr:`options`, defaults filled in; ValueError names the option."""
        return checked(cls.options, given, f"wire codec {cls.name!r}")

    @property
    def encoded(self) -> bool:
        """True when snapshots are encoded to travel (and decoded on arrival)."""
        return type(self).sender is not Codec.sender

    @abstractmethod
    def max_nbytes(self) -> int:
        """The most bytes one reply's payload holds."""

    def nbytes(self, reply: Fields) -> int:
        """The bytes the payload of a reply with these header fields must hold."""
        return self.max_nbytes()

    def sender(self, peers: int) -> Sender | None:
        """This node's encoder (None: the kept array travels as it is). `peers`: how many peers it may serve,
        for a codec that keeps state per peer (its memory budget)."""
        return None

    def receiver(self, peers: int) -> Receiver | None:
        """This node's decoder (None: the kept array arrives as it is)."""
        return None
