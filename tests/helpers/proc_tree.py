"""Process-tree lookups for tests that must stop what they started by PID (torchrun's workers each run
in a session of their own, so killing the agent's group does not reach them)."""

from __future__ import annotations

from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found
