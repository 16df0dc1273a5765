"""float32, float16 and bfloat16: the kept array travels as it is, without a copy.

Snapshots are kept in the wire dtype itself (bfloat16 stored as uint16: numpy has
none), so a node sends the published array and a peer blends from the bytes it
received (:mod:`dpwa.mixing.kernels` decodes half precision block by block).
"""

from __future__ import annotations

from ..kernels import WIRE_STORAGE
from .base import Codec

__all__ = ["BFloat16", "Float16", "Float32"]


class _Plain(Codec):
    def max_nbytes(self) -> int:
        return self.size * WIRE_STORAGE[self.kept].itemsize


class Float32(_Plain):
    name = kept = "float32"
    summary = "4 bytes a value, exact"


class Float16(_Plain):
    name = kept = "float16"
    summary = "2 bytes a value, IEEE half precision"


class BFloat16(_Plain):
    name = kept = "bfloat16"
    summary = "2 bytes a value, float32's range with 8 bits of mantissa"


CODECS = (Float32, Float16, BFloat16)
