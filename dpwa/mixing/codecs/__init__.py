"""Wire codecs: the interface (:mod:`.base`) and one module per codec, found by name.

Each module here other than ``base`` defines ``CODECS``, a tuple of :class:`Codec`
subclasses, each found by its ``name`` (the config's ``wire_dtype``): adding a
codec is adding a file.

==========  ==============================================================  =========
codec       on the wire                                                     modes
==========  ==============================================================  =========
float32     4 bytes a value                                                 both
float16     2 bytes a value                                                 both
bfloat16    2 bytes a value                                                 both
int8        a scale per 1024 values, a byte a value; error feedback         both
topk        the largest 5% of the change since the peer's copy (CHOCO)      pull
==========  ==============================================================  =========
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from .base import Codec, CodecError, Encoded, Fields, Receiver, Sender

__all__ = ["Codec", "CodecError", "Encoded", "Fields", "Receiver", "Sender", "builtin", "codec_class", "names"]


@functools.cache
def _found() -> tuple[tuple[str, type[Codec]], ...]:
    found: dict[str, type[Codec]] = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name == "base":
            continue
        for codec in getattr(importlib.import_module(f"{__name__}.{module.name}"), "CODECS", ()):
            if isinstance(codec, type) and issubclass(codec, Codec):
                found[codec.name] = codec
    order = ("float32", "float16", "bfloat16")  # the plain ones first, as the docs list them
    return tuple(sorted(found.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def builtin() -> dict[str, type[Codec]]:
    """The codecs that ship with dpwa, by name."""
    return dict(_found())


def names() -> tuple[str, ...]:
    """Every codec's name: the values ``wire_dtype`` takes."""
    return tuple(name for name, _ in _found())


def codec_class(name: str) -> type[Codec]:
    """The codec called `name`; ValueError listing the others if there is none."""
    codecs = builtin()
    if name not in codecs:
        raise ValueError(f"unknown wire codec {name!r}; expected one of {', '.join(codecs)}")
    return codecs[name]
