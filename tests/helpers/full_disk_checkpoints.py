"""Checkpoints on a full disk. Run inside a private mount namespace with a small tmpfs mounted at
argv[1]; prints one JSON line of what happened for the test to check."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import torch

from dpwa.runfiles import checkpoints


def state(n: int, k: float) -> dict:
    return {"model": {"w": torch.full((n,), k)}, "progress": {"epoch": int(k)}}


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def fill_leaving(path: Path, leave: int) -> None:
    """Write a filler file so that exactly `leave` bytes (a whole number of pages) stay free."""
    with open(path / f"filler-{leave}", "wb") as fh:
        fh.write(b"\0" * (free_bytes(path) - leave))
    assert free_bytes(path) == leave, (free_bytes(path), leave)


def main() -> int:
    run = Path(sys.argv[1])
    page = os.statvfs(run).f_frsize
    result: dict = {}
    for node in ("a", "b"):
        checkpoints.save(run, 1, node, state(1000, 1.0))
    # 1. The node's file does not fit: nothing is left behind, epoch 1 stays the complete one.
    fill_leaving(run, 32 * page)
    try:
        checkpoints.save(run, 2, "a", state(1_000_000, 2.0))  # 4 MB
    except checkpoints.CheckpointError as exc:
        result["file_error"] = str(exc)
    # 2. The node's file fits exactly, its manifest does not: the unlisted file is removed.
    buffer = io.BytesIO()
    torch.save(state(10_000, 2.0), buffer)
    fill_leaving(run, -(-len(buffer.getvalue()) // page) * page)
    try:
        checkpoints.save(run, 2, "b", state(10_000, 2.0))
    except checkpoints.CheckpointError as exc:
        result["manifest_error"] = str(exc)
    epoch2 = checkpoints.checkpoint_dir(run, 2)
    result["left_in_epoch_2"] = sorted(p.name for p in epoch2.iterdir()) if epoch2.is_dir() else []
    result["latest"] = checkpoints.latest_complete(run, ["a", "b"])
    result["loaded"] = float(checkpoints.load(run, 1, "b")["model"]["w"][0])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
