"""What a model looks like on the wire: its layout's fingerprint, its wire dtype and its size.

Two nodes exchange snapshots only when these agree; every piece that sends,
receives, serves or checks a snapshot is given one :class:`WireModel` instead
of the three numbers apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .codecs import Codec, Fields, codec_class
from .kernels import storage_dtype

__all__ = ["WireModel"]


@dataclass(frozen=True)
class WireModel:
    """A model as it travels: ``size`` elements of wire dtype ``dtype``, laid out as ``fingerprint`` says.

    ``dtype`` names the wire codec (:mod:`dpwa.mixing.codecs`). Snapshots are kept (and blended from) in
    the codec's ``kept`` dtype: the wire dtype itself for float32, float16 and bfloat16; float32 for a
    compressing codec (int8, topk), which encodes them as they are sent.
    """

    fingerprint: bytes  # a digest of every tensor's name, shape and dtype (dpwa.mixing.params.fingerprint)
    dtype: str  # the wire codec's name: float32, float16, bfloat16, int8, topk
    size: int  # elements
    rule: bytes | None = None  # the mixing rule's fingerprint (dpwa.mixing.rules), sent with every request and reply
    options: tuple[tuple[str, Any], ...] = ()  # the codec's settings (the config's wire_options)
    codec: Codec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", codec_class(self.dtype)(self.size, dict(self.options)))

    @property
    def encoded(self) -> bool:
        """Snapshots are encoded to travel (int8, topk), and decoded on arrival."""
        return self.codec.encoded

    @property
    def kept(self) -> str:
        """The dtype snapshots are kept and blended in: float32, float16 or bfloat16."""
        return self.codec.kept

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype a snapshot is kept in (bfloat16 as uint16)."""
        return storage_dtype(self.kept)

    @property
    def kept_nbytes(self) -> int:
        """Bytes of one snapshot as kept (in a slot, in a join offer)."""
        return self.size * self.storage.itemsize

    @property
    def nbytes(self) -> int:
        """The most bytes of one snapshot on the wire."""
        return self.codec.max_nbytes()

    def payload_nbytes(self, header: Fields) -> int:
        """The bytes the payload of a snapshot with this header must hold (a codec's may vary)."""
        return self.codec.nbytes(header)
