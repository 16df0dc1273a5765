"""Which files of the package one symmetric exchange goes through, from update_send to both halves applied.

    .venv/bin/python scripts/exchange-trip.py          # the files, with how many calls each, and the spine
    .venv/bin/python scripts/exchange-trip.py --calls  # and every call from one file into another

Two nodes in this process (127.0.0.1, free ports, the defaults but join: never) exchange a few times to warm up;
then every call into a module of dpwa/ is recorded, on every thread, from w0's update_send to w1's update_wait
that applies the mirrored half. A file counts once however often it is entered.

Two counts:
  entered  every file of dpwa/ a function of which runs on the way: the exchange's own code, and what it
           consults (flow control, deadlines, the clock, counters, the path, codecs, the wire's frames);
  spine    every file of dpwa/ on the call stack each time the exchange's state changes or a half is applied:
           at each call into the state machine (dpwa/gossip/exchange/machine.py) or into the mixing rule
           (dpwa/mixing/rules/), the files of every frame below it. These are the files the exchange passes
           through; the others it asks on the way and returns from.
docs/design.md, 'One exchange's trip', quotes both; tests/test_exchange_trip.py holds the spine.
"""

from __future__ import annotations

import collections
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from dpwa import Node, NumpyParams

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "dpwa")
STATE = ("dpwa/gossip/exchange/machine.py", "dpwa/mixing/rules/")  # where the exchange's state changes, halves apply
recording = False
files: collections.Counter[str] = collections.Counter()
calls: collections.Counter[tuple[str, str, str]] = collections.Counter()
spine: set[str] = set()


def profile(frame: FrameType, event: str, arg: Any) -> None:
    if not recording or event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
        return
    here = str(Path(frame.f_code.co_filename).relative_to(ROOT))
    files[here] += 1
    caller = frame.f_back
    if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
        there = str(Path(caller.f_code.co_filename).relative_to(ROOT))
        if there != here:
            calls[(there, here, frame.f_code.co_name)] += 1
    if here.startswith(STATE):
        below: FrameType | None = frame
        while below is not None:
            if below.f_code.co_filename.startswith(PACKAGE):
                spine.add(str(Path(below.f_code.co_filename).relative_to(ROOT)))
            below = below.f_back


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trip() -> bool:
    """Record one symmetric exchange into `files`, `calls` and `spine`; whether it averaged."""
    global recording
    nodes = [{"name": f"w{i}", "host": "127.0.0.1", "port": free_port()} for i in range(2)]
    config = {"nodes": nodes, "join": "never"}
    threading.setprofile(profile)
    sys.setprofile(profile)
    mine, theirs = np.zeros(1000, np.float32), np.full(1000, 10.0, np.float32)
    with (
        Node({**config, "fetch_probability": 0}, "w1", NumpyParams(theirs)) as peer,
        Node(config, "w0", NumpyParams(mine)) as node,
    ):
        peer.update_send()
        for _ in range(3):  # warm up: imports, first publishes, first requests
            node.update_send()
            node.update_wait()
            peer.update_send()
            peer.update_wait()
        recording = True
        node.update_send()
        update = node.update_wait()
        peer.update_send()
        peer.update_wait()
        recording = False
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    if not update.averaged:
        print(f"the exchange did not average ({update.reason}); run again", file=sys.stderr)
    return bool(update.averaged)


def gossip(names: Any) -> list[str]:
    return [name for name in names if name.startswith("dpwa/gossip/")]


def main() -> int:
    if not trip():
        return 1
    for name, count in sorted(files.items()):
        print(f"{count:6d}  {name}{'  (spine)' if name in spine else ''}")
    print(f"entered: {len(files)} files of dpwa/ ({len(gossip(files))} of dpwa/gossip/); {len(calls)} distinct calls")
    print(f"spine: {len(spine)} files of dpwa/ ({len(gossip(spine))} of dpwa/gossip/): {', '.join(sorted(spine))}")
    if "--calls" in sys.argv:
        for (caller, callee, function), count in sorted(calls.items()):
            print(f"  {caller} -> {callee}: {function} x{count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
