"""Small datasets shipped inside the lab's package, so examples and tests need no download.

    python -c "from dpwa_lab.workloads.digits import load_digits; x, y = load_digits(); print(x.shape, y.shape)"

Only numpy is needed; nothing is unpickled. See ``lab/dpwa_lab/data/README.md`` for the
source and license of each file.
"""

from __future__ import annotations

import gzip
import importlib.resources

import numpy as np

__all__ = ["DIGITS_ROWS", "load_digits"]

DIGITS_ROWS = 1797  # rows of digits.csv.gz: the UCI optdigits test part


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The embedded handwritten digits: images (1797, 8, 8) uint8 in 0..16, labels (1797,) int64 in 0..9."""
    resource = importlib.resources.files("dpwa_lab") / "data" / "digits.csv.gz"
    with resource.open("rb") as raw, gzip.open(raw, "rt", encoding="ascii") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.int64)
    if table.shape != (DIGITS_ROWS, 65) or table[:, :64].min() < 0 or table[:, :64].max() > 16:
        raise ValueError(
            f"{resource}: expected {DIGITS_ROWS} rows of 64 pixels in 0..16 and a label, got shape {table.shape}"
        )
    images = table[:, :64].astype(np.uint8).reshape(-1, 8, 8)
    labels = table[:, 64]
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{resource}: labels must be in 0..9, got {labels.min()}..{labels.max()}")
    return images, labels
