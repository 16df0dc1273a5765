"""A hostile member of a cluster, in a process of its own: it asks one node for exchanges it never
completes, as fast as answers come, until its stdin closes (or `limit_s` passes).

Run as ``python tests/helpers/hostile_member.py SPEC`` with ``tests`` on the path; SPEC is JSON with the
cluster's ``config``, the ``server`` to attack, the attack's ``name`` and ``size`` (float32 parameters),
the model's ``fingerprint`` and its rule's ``rule`` (hex), and ``limit_s``. Attacks:

- ``never_confirms``: exchanges that carry a valid snapshot (zeros) and are never confirmed;
- ``stalling_streams``: ``bulk_exchange`` requests whose snapshot is offered at a port that sends one
  byte and then nothing (:class:`helpers.flood.Trickle`).

It prints ``ready`` once its first request was answered, and at the end one JSON line: the answers
counted by kind (``params``) or refusal reason (``busy``, ...).
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import zmq

from helpers.flood import Trickle
from helpers.raw_peer import RawPeer, bulk_exchange_header


def main(spec: dict) -> None:
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()  # returns when the test closes our stdin (or dies)
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    ctx = zmq.Context()
    raw = RawPeer(ctx, spec["config"], "w2", server=spec["server"])
    fingerprint, size = bytes.fromhex(spec["fingerprint"]), spec["size"]
    rule = bytes.fromhex(spec["rule"])  # the cluster's rule fingerprint: a member names it
    trickle = Trickle() if spec["name"] == "stalling_streams" else None
    payload = np.zeros(size, np.float32)
    answers: dict[str, int] = {}
    deadline = time.monotonic() + spec["limit_s"]
    try:
        for count in range(10_000_000):
            if stop.is_set() or time.monotonic() > deadline:
                break
            if trickle is not None:
                header = bulk_exchange_header(fingerprint, trickle.port, name="w2", nbytes=size * 4, rule=rule)
                reply = raw._ask([header])
            else:
                reply = raw.exchange_with(fingerprint, payload, rule=rule)
            answer = reply["reason"] if reply.kind == "error" else reply.kind
            answers[answer] = answers.get(answer, 0) + 1
            if count == 0:
                print("ready", flush=True)
            if answer != "params":
                stop.wait(0.001)  # refused: ask again at once (a millisecond, not to spin)
    finally:
        if trickle is not None:
            trickle.close()
        raw.sock.close(linger=0)
        ctx.term()
    print(json.dumps(answers), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
