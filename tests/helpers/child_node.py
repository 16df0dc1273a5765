"""A dpwa node in its own process, driven by JSON lines on stdin (used by the tests).

Options (JSON): size, fill (every element = fill) or seed (a seeded random
pattern), rng_seed (fetch decisions), fetch (False: never fetch; this node only
serves).

Commands: {"cmd": "steps", "n": N} runs N update_send / update_wait pairs and
answers {"event": "steps_done", ...}; {"cmd": "churn"} starts publishing
snapshots as fast as it can, the k-th with every element equal to k, until
{"cmd": "churn_stop"} (answered with "churn_done"); {"cmd": "values"} answers the parameter
summary; {"cmd": "exit"} (or end of stdin) closes the node and exits 0.
"""

import argparse
import json
import os
import random
import sys
import threading
from pathlib import Path

import numpy as np

from dpwa import Node, NumpyParams, load_config, parse_config
from dpwa.signals import stop_on_signals


def say(**message):
    print(json.dumps(message), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()
    options = json.loads(args.options)
    size = options.get("size", 1000)
    if "seed" in options:
        values = np.random.default_rng(options["seed"]).standard_normal(size).astype(np.float32)
    else:
        values = np.full(size, float(options.get("fill", 0.0)), dtype=np.float32)
    config = load_config(args.config)
    if not options.get("fetch", True):
        raw = json.loads(Path(args.config).read_text())
        raw["fetch_probability"] = 0
        config = parse_config(raw, source=args.config)
    node = Node(config, args.name, NumpyParams(values), rng=random.Random(options.get("rng_seed")))
    with stop_on_signals():
        try:
            serve(node, values, args)
        finally:
            node.close()
            say(event="closed")
    return 0


def serve(node, values, args) -> None:
    churning, churner = threading.Event(), None
    node.update_send()  # publish once so peers can fetch at once
    node.update_wait()
    say(event="ready", name=args.name, pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "exit":
            return
        if command["cmd"] == "steps":
            outcomes = []
            for _ in range(command["n"]):
                node.update_send()
                update = node.update_wait()
                outcomes.append([update.outcome, update.peer])
            say(
                event="steps_done",
                outcomes=outcomes,
                mean=float(values.mean()),
                min=float(values.min()),
                max=float(values.max()),
                stats=_jsonable(node.stats()),
            )
        elif command["cmd"] == "churn":
            churning.set()
            churner = threading.Thread(target=churn, args=(node, values, churning))
            churner.start()  # the only thread publishing until churn_stop
        elif command["cmd"] == "churn_stop":
            churning.clear()
            if churner is not None:
                churner.join(30)
            say(event="churn_done", stats=_jsonable(node.stats()))
        elif command["cmd"] == "values":
            say(event="values", values=values.tolist())


def churn(node, values, churning) -> None:
    """Publish snapshots whose elements all equal the step number, as fast as possible."""
    step = 0
    while churning.is_set():
        step += 1
        values.fill(float(step))
        node.update_send()
        node.update_wait()


def _jsonable(stats):
    return json.loads(json.dumps(stats, default=str))


if __name__ == "__main__":
    sys.exit(main())
