"""What a model looks like on the wire: its layout's fingerprint, its wire dtype and its size.

Two nodes exchange snapshots only when these agree; every piece that sends,
receives, serves or checks a snapshot is given one :class:`WireModel` instead
of the three numbers apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kernels import storage_dtype

__all__ = ["WireModel"]


@dataclass(frozen=True)
class WireModel:
    """A model as it travels: ``size`` elements of wire dtype ``dtype``, laid out as ``fingerprint`` says."""

    fingerprint: bytes  # a digest of every tensor's name, shape and dtype (dpwa.mixing.params.fingerprint)
    dtype: str  # the wire dtype: float32, float16 or bfloat16
    size: int  # elements

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype a snapshot is kept in (bfloat16 as uint16)."""
        return storage_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of one snapshot on the wire."""
        return self.size * self.storage.itemsize
