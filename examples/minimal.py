"""dpwa in a complete script: the embedded digits, a small model, and one call at the optimizer.

    torchrun --nproc-per-node 2 examples/minimal.py          # no config needed: the torchrun defaults
    DPWA_CONFIG=samples/local-2.yaml DPWA_NAME=w1 python examples/minimal.py   # and w2, in another terminal
    ./run.sh --nodes 2 -- python examples/minimal.py     # dpwa's launcher: the live table, --chaos, --dashboard

Each node trains on its shard of the digits (rows rank::world_size; the last 297 are the test set) and
averages with the others through dpwa.gossip_optimizer (a node done first serves the others for up to 5 s).
It prints one line, ``minimal-result {...}``. DPWA_EPOCHS=N trains N epochs instead of 10. The digits are
dpwa's lab's (lab/, the package dpwa_lab): ``pip install -e . -e lab`` from the repository root (run.sh does).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import dpwa
from dpwa_lab.workloads.digits import load_digits

EPOCHS, BATCH, TEST_ROWS = int(os.environ.get("DPWA_EPOCHS", "10")), 32, 297


def main() -> None:
    torch.set_num_threads(1)  # one core per node
    images, labels = load_digits()
    x, y = torch.tensor(images, dtype=torch.float32).flatten(1) / 16, torch.tensor(labels)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []  # each epoch's mean loss
    with dpwa.gossip_optimizer(opt, net, batch_size=BATCH, linger_s=5) as conn:  # config, name: from $DPWA_*
        if not (conn.adapter.joined and conn.adapter.joined.rejoined):  # late (the cluster trains): wait for none
            conn.adapter.barrier("start", timeout_s=60)  # every node up before anyone trains
        xs, ys = x[:-TEST_ROWS][conn.rank :: conn.world_size], y[:-TEST_ROWS][conn.rank :: conn.world_size]
        for _ in range(EPOCHS):
            batches = torch.randperm(len(xs)).split(BATCH)
            total = 0.0
            for batch in batches:
                loss = nn.functional.cross_entropy(net(xs[batch]), ys[batch])
                opt.zero_grad()
                loss.backward()
                conn.loss = loss  # optional: the loss peers see
                opt.step()  # and the exchange: blend in the last one, start the next
                total += loss.item()
            losses.append(total / len(batches))
    with torch.no_grad():
        accuracy = (net(x[-TEST_ROWS:]).argmax(1) == y[-TEST_ROWS:]).float().mean().item()
    result = {"name": conn.name, "rank": conn.rank, "world_size": conn.world_size, "averaged": conn.averaged}
    result |= {"first_loss": losses[0], "last_loss": losses[-1], "accuracy": accuracy}
    print(f"minimal-result {json.dumps(result)}\n", end="", flush=True)  # one write: ranks share a stdout


if __name__ == "__main__":
    main()
