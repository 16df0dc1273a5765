"""What a model looks like on the wire: its layout's fingerprint, its wire dtype and its size.

Two nodes exchange snapshots only when these agree; every piece that sends,
receives, serves or checks a snapshot is given one :class:`WireModel` instead
of the three numbers apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernels import storage_dtype
from .quantize import encoded_bytes

__all__ = ["WireModel"]


@dataclass(frozen=True)
class WireModel:
    """A model as it travels: ``size`` elements of wire dtype ``dtype``, laid out as ``fingerprint`` says.

    Snapshots are kept (and blended from) in ``kept``: the wire dtype itself, except for ``int8``, whose
    snapshots are kept in float32 and encoded as they are sent (:mod:`dpwa.mixing.quantize`).
    """

    fingerprint: bytes  # a digest of every tensor's name, shape and dtype (dpwa.mixing.params.fingerprint)
    dtype: str  # the wire dtype: float32, float16, bfloat16 or int8
    size: int  # elements
    rule: bytes | None = None  # the mixing rule's fingerprint (dpwa.mixing.rules), sent with every request and reply

    @property
    def encoded(self) -> bool:
        """Snapshots are encoded to travel (int8), and decoded on arrival."""
        return self.dtype == "int8"

    @property
    def kept(self) -> str:
        """The dtype snapshots are kept and blended in: float32, float16 or bfloat16."""
        return "float32" if self.encoded else self.dtype

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
        """Bytes of one snapshot on the wire."""
        return encoded_bytes(self.size) if self.encoded else self.kept_nbytes
