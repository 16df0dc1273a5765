"""Two nodes with a ResNet-18-sized model (44.7 MB) in one process, for a test that runs it
under a small /dev/shm (a private tmpfs of 64 MB, like Docker's default). Prints one JSON line."""

from __future__ import annotations

import json
import logging
import sys
import threading

import numpy as np

from dpwa import Node, NumpyParams

SIZE = 11_173_962


def main() -> int:
    config = json.loads(sys.argv[1])
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("dpwa").addHandler(Keep())
    logging.getLogger("dpwa").setLevel(logging.INFO)
    arrays = [np.full(SIZE, float(k), np.float32) for k in (0, 8)]
    averaged = [0, 0]
    outcomes: list[list[str]] = [[], []]
    with Node(config, "w0", NumpyParams(arrays[0])) as a, Node(config, "w1", NumpyParams(arrays[1])) as b:

        def train(k: int, node: Node) -> None:
            for step in range(8):  # the first steps may find the peer not started yet
                node.update_send()
                arrays[k] += 1.0  # a training step
                update = node.update_wait()
                averaged[k] += update.averaged and step >= 2
                outcomes[k].append(update.outcome)

        threads = [threading.Thread(target=train, args=(k, node)) for k, node in enumerate((a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stats = [a.stats(), b.stats()]
    print(
        json.dumps(
            {
                "averaged": averaged,
                "outcomes": outcomes,
                "values": [float(arrays[0][0]), float(arrays[1][0])],
                "uniform": [bool(np.all(x == x[0])) for x in arrays],
                "same_host_fetches": [s["same_host_fetches"] for s in stats],
                "shm_warnings": [m for m in records if "shared memory failed" in m],
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
