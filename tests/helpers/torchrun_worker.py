"""A torchrun worker for the tests: a tiny model, `nodes: torchrun`, a few steps; writes OUT/rankN.json.

    torchrun --standalone --nproc-per-node 3 tests/helpers/torchrun_worker.py OUT_DIR [STEPS] [plain]

"plain": a plain training loop, no barrier of its own (the constructor starts every rank together).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from dpwa import DpwaPyTorchAdapter


def main() -> int:
    out = Path(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    plain = len(sys.argv) > 3 and sys.argv[3] == "plain"
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)  # different initial weights: joining at start makes them rank 0's
    net = nn.Linear(4, 2)
    config = {"nodes": "torchrun", "fetch_probability": 1, "timeout_ms": 3000}
    with DpwaPyTorchAdapter(net, None, config) as conn:
        start = [p.detach().clone() for p in net.parameters()]
        if not plain:
            conn.barrier("start", timeout_s=60)  # every worker is up (and has joined) before anyone trains
        for _ in range(steps):
            conn.update_send(None)
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.01 * (rank + 1))  # a known step per rank
            time.sleep(0.005)  # the step's compute: a real one takes longer than an exchange (not a synchronization)
            conn.update_wait(None)
        # every exchange that moved this rank, started by it or by the peer (mode symmetric moves both sides)
        peers = {name: peer["averaged"] for name, peer in conn.stats()["peers"].items() if peer.get("averaged")}
        if not plain:
            conn.barrier("exit", timeout_s=60)
        result = {
            "name": conn.name,
            "peers": peers,
            "nodes": [(n.name, n.host, n.port) for n in conn.node.config.nodes],
            "secure": conn.node.config.secure,
            "transport": conn.node.config.transport,
            "start": [t.tolist() for t in start],
            "joined": None if conn.joined is None else conn.joined.donor,
        }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
