"""The charlm workload: a small GPT-style character-level transformer, on text every Python installation has.

**The model** (:class:`CharTransformer`): token and position embeddings, pre-LayerNorm
blocks of causal multi-head self-attention (``scaled_dot_product_attention`` with
``is_causal=True``) and a GELU MLP four times as wide, a last LayerNorm and a
linear head. Its vocabulary is the 256 byte values: any text file works, and the
Python standard library is ASCII but for about one byte in 1,700, so a byte is a
character there (bits per character = bits per byte). It has no buffers and no
dropout. Sizes (:data:`SIZES`):

==========  ========  =====  ======  =====  ===========
size        context   width  layers  heads  parameters
==========  ========  =====  ======  =====  ===========
``small``   128       64     3       4      191,296 (765 KB in float32)
``tiny``    32        32     1       2      30,432 (for tests)
``medium``  256       256    6       8      4,935,936 (19.7 MB; for a GPU: ``scripts/gpu-check.sh``)
==========  ========  =====  ======  =====  ===========

One training step of ``small`` on a batch of 32 sequences (4,096 characters)
takes about 125-160 ms on one CPU thread of the 2-core machine it was sized on
(``torch.set_num_threads(1)``; forward, backward and an SGD step).

**The text** (:func:`load`): ``stdlib`` is the running interpreter's standard
library (``sysconfig.get_paths()["stdlib"]``): every ``.py`` file under it but
those in a folder named ``test*``, ``idle_test`` or ``site-packages`` (734 files,
12.1 MB for CPython 3.11 here). Each file goes to validation when the SHA-256 of
its path relative to the stdlib folder, read as a fraction of 2**64, is below
:data:`VALID_FRACTION`, else to training: a split by file, the same on every
machine with the same Python, whatever order the folder lists its files in. Each
side is the concatenation of its files in the order of that hash (spread over the
whole library) cut at its cap: :data:`TRAIN_CAP_BYTES` (4 MiB) for training,
:data:`VALID_CAP_BYTES` (512 KiB) for validation, so loading takes a fraction of a
second. ``text:PATH`` is a file of yours: its last :data:`VALID_FRACTION` (by
position) is validation, the rest training.

**Shards and batches**: worker i of n trains on part i of n of the training text
(contiguous, disjoint; :func:`shard`). An epoch of a shard is its non-overlapping
windows of ``context + 1`` characters from a random offset, in a random order
(:func:`batches`); a sample is one window (``context`` characters predicted).

**The metric**: the mean cross-entropy of the next character on fixed windows of the
validation text (:func:`validation_windows`, :func:`evaluate`), in nats per
character; divided by ln 2 it is bits per character (:func:`bits`). Next-character
accuracy comes with it.

    python -m dpwa.workloads.charlm            # prints the text's and the model's sizes
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SIZES",
    "TRAIN_CAP_BYTES",
    "VALID_CAP_BYTES",
    "VALID_FRACTION",
    "VOCAB",
    "CharLMConfig",
    "CharTransformer",
    "TextData",
    "batches",
    "bits",
    "build",
    "evaluate",
    "load",
    "load_stdlib",
    "load_text",
    "loss",
    "shard",
    "stdlib_files",
    "validation_fraction",
    "validation_windows",
    "epoch_order",
    "windows",
    "windows_per_epoch",
]

VOCAB = 256  # byte values
VALID_FRACTION = 0.1  # stdlib: the share of files (by hash) for validation; text:PATH: the share at the end
TRAIN_CAP_BYTES = 4 << 20  # training text used from the stdlib, at most
VALID_CAP_BYTES = 512 << 10  # validation text used from the stdlib, at most
TEXT_MAX_BYTES = 1 << 30  # a text:PATH file larger than this is refused (it is read into memory)
EXCLUDED_DIRS = ("site-packages", "idle_test")  # and every folder whose name starts with "test"


@dataclass(frozen=True)
class CharLMConfig:
    """The transformer's shape."""

    context: int = 128  # characters a sequence holds (and predicts)
    dim: int = 64  # width of the residual stream
    layers: int = 3
    heads: int = 4  # dim must divide by heads
    vocab: int = VOCAB

    def __post_init__(self) -> None:
        for name in ("context", "dim", "layers", "heads", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be a multiple of heads ({self.heads})")


SIZES = {
    "small": CharLMConfig(context=128, dim=64, layers=3, heads=4),
    "tiny": CharLMConfig(context=32, dim=32, layers=1, heads=2),
    "medium": CharLMConfig(context=256, dim=256, layers=6, heads=8),
}


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    """One pre-LayerNorm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """A GPT-style causal transformer over bytes: (batch, time) int64 in, (batch, time, vocab) logits out."""

    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Embedding(config.context, config.dim)
        self.blocks = nn.Sequential(*(Block(config.dim, config.heads) for _ in range(config.layers)))
        self.ln = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.config.context:
            raise ValueError(f"a sequence of {t} characters is longer than the context ({self.config.context})")
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        return self.head(self.ln(self.blocks(h)))


def build(size: str | CharLMConfig = "small", seed: int | None = None) -> CharTransformer:
    """The model of `size` (a name in :data:`SIZES`, or a config), with weights drawn from `seed` if given."""
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown charlm size {size!r}; choose one of {', '.join(SIZES)}")
        size = SIZES[size]
    if seed is not None:
        torch.manual_seed(seed)
    return CharTransformer(size)


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the next character over every position of the batch (nats per character)."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def bits(nats: float) -> float:
    """Nats per character as bits per character."""
    return nats / math.log(2)


# --------------------------------------------------------------------------- the text


@dataclass(frozen=True)
class TextData:
    """Training and validation text as bytes (uint8 arrays), and where they came from."""

    source: str  # "stdlib" or "text:PATH"
    train: np.ndarray
    valid: np.ndarray
    train_files: int = 0  # stdlib: files (or parts of one, at the cap) in each side
    valid_files: int = 0

    def describe(self) -> str:
        files = f" from {self.train_files} and {self.valid_files} files" if self.train_files else ""
        return f"{self.source}: {len(self.train):,} training and {len(self.valid):,} validation characters{files}"


def validation_fraction(relative: str) -> float:
    """Where `relative` (a path relative to the stdlib folder, with /) falls in [0, 1): SHA-256 over 2**64."""
    digest = hashlib.sha256(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def stdlib_files(root: Path | None = None) -> list[str]:
    """The stdlib's ``.py`` files used (paths relative to `root`, with /), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no standard library folder here")
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (d.startswith("test") or d in EXCLUDED_DIRS)]  # not even walked
        base = Path(folder).relative_to(root)
        out += [(base / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(out)


def _concatenate(root: Path, files: list[str], cap: int) -> tuple[np.ndarray, int]:
    parts, size, used = [], 0, 0
    for relative in files:
        if size >= cap:
            break
        data = (root / relative).read_bytes()[: cap - size]
        parts.append(data)
        size += len(data)
        used += 1
    return np.frombuffer(b"".join(parts), dtype=np.uint8).copy(), used


def load_stdlib(
    root: Path | None = None,
    *,
    train_cap: int = TRAIN_CAP_BYTES,
    valid_cap: int = VALID_CAP_BYTES,
    fraction: float = VALID_FRACTION,
) -> TextData:
    """The standard library's source, split by file into training and validation text (see the module)."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if train_cap < 1 or valid_cap < 1:
        raise ValueError(f"the caps must be positive, got {train_cap} and {valid_cap}")
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = sorted(stdlib_files(root), key=lambda r: (validation_fraction(r), r))
    valid = [r for r in files if validation_fraction(r) < fraction]
    train = [r for r in files if validation_fraction(r) >= fraction]
    if not train or not valid:
        raise ValueError(f"{root}: {len(train)} training and {len(valid)} validation files; need at least one of each")
    train_text, train_used = _concatenate(root, train, train_cap)
    valid_text, valid_used = _concatenate(root, valid, valid_cap)
    return TextData("stdlib", train_text, valid_text, train_used, valid_used)


def load_text(path: str | Path, fraction: float = VALID_FRACTION) -> TextData:
    """A text file of yours: its last `fraction` (by position) is validation, the rest training."""
    path = Path(path)
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise FileNotFoundError(f"{path}: cannot read the text file ({exc.strerror})") from exc
    if size > TEXT_MAX_BYTES:
        raise ValueError(f"{path}: {size:,} bytes is more than the {TEXT_MAX_BYTES:,} a text file may have here")
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8).copy()
    n_valid = math.ceil(len(data) * fraction)
    if len(data) < 2 or n_valid >= len(data):
        raise ValueError(f"{path}: {len(data)} bytes is too short to split into training and validation text")
    return TextData(f"text:{path}", data[:-n_valid], data[-n_valid:])


def load(source: str) -> TextData:
    """``stdlib`` or ``text:PATH``."""
    if source == "stdlib":
        return load_stdlib()
    if source.startswith("text:") and len(source) > len("text:"):
        return load_text(source[len("text:") :])
    raise ValueError(f"charlm data must be 'stdlib' or 'text:PATH', got {source!r}")


# --------------------------------------------------------------------------- shards, batches, evaluation


def shard(text: np.ndarray, index: int, count: int) -> np.ndarray:
    """Part `index` of `count` of `text`: contiguous, disjoint, together all of it."""
    if not 0 <= index < count:
        raise ValueError(f"shard index must be in 0..{count - 1}, got {index}")
    return np.array_split(text, count)[index]


def windows_per_epoch(length: int, context: int) -> int:
    """Windows of ``context + 1`` characters an epoch of a text of `length` gives, whatever its random offset."""
    return max(0, (length - context) // context - 1) if length > context else 0


def batches(
    text: np.ndarray | torch.Tensor, batch_size: int, context: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of (input, target) batches of `text`: windows from a random offset, in a random order, full batches.

    Inputs and targets are (batch_size, context) int64; the target is the input shifted by one character.
    """
    tokens = _tokens(text)
    offset, order = epoch_order(len(tokens), context, generator)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield windows(tokens, offset + order[start : start + batch_size] * context, context)


def _tokens(text: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(text, np.ndarray) and not text.flags.writeable:
        text = text.copy()  # torch wants memory it could write
    return torch.as_tensor(text)


def epoch_order(length: int, context: int, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """An epoch's random offset (in 0..context-1) and random order of its windows (window k starts at
    offset + k * context)."""
    offset = int(torch.randint(0, context, (1,), generator=generator))
    return offset, torch.randperm(windows_per_epoch(length, context), generator=generator)


def windows(text: np.ndarray | torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows of ``context + 1`` characters of `text` at `starts`: (inputs, targets), int64."""
    tokens = _tokens(text)
    window = tokens[starts[:, None] + torch.arange(context + 1)].long()
    return window[:, :-1], window[:, 1:]


def validation_windows(text: np.ndarray, context: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` windows spread evenly over `text` (fewer if it is short): inputs and targets, int64."""
    n = (len(text) - 1) // context
    if n < 1:
        raise ValueError(f"{len(text)} characters of validation text hold no window of {context + 1}")
    index = np.unique(np.linspace(0, n - 1, min(count, n)).round().astype(np.int64))
    return windows(text, torch.as_tensor(index * context), context)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 64) -> tuple[float, float]:
    """(mean cross-entropy in nats per character, next-character accuracy) of `model` on windows `x`, `y`."""
    was_training = model.training
    model.eval()
    total, correct = 0.0, 0
    try:
        for start in range(0, len(x), batch_size):
            logits = model(x[start : start + batch_size])
            target = y[start : start + batch_size]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
            correct += int((logits.argmax(-1) == target).sum())
    finally:
        model.train(was_training)
    return total / y.numel(), correct / y.numel()


def _main() -> None:
    import argparse
    import time

    parser = argparse.ArgumentParser(prog="python -m dpwa_lab.workloads.charlm", description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="stdlib", help="stdlib (default) or text:PATH")
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    args = parser.parse_args()
    t0 = time.perf_counter()
    data = load(args.data)
    print(f"{data.describe()} (loaded in {time.perf_counter() - t0:.2f} s)")
    model = build(args.size)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.size}: {model.config}, {n:,} parameters ({4 * n:,} bytes in float32)")


if __name__ == "__main__":
    _main()
