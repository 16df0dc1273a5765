"""A user's training script as `python -m dpwa run` starts it: nothing about dpwa on its command line.

The digits MLP of examples/minimal.py, trained for $STEPS optimizer steps (default 300) under
dpwa.gossip_optimizer, which finds its config, name and run folder in $DPWA_CONFIG, $DPWA_NAME and
$DPWA_RUN_DIR and writes the node's metrics lines there. With $STOP_FILE set it trains until that file
exists instead, $STEPS being then only a ceiling: a test ends the run once what it waits for has happened,
not after a step count sized for a quiet machine. Prints ``script-result {json}`` at the end (its
"stopped_by": "stop file" or "steps").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

import dpwa
from dpwa_lab.workloads.digits import load_digits


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = int(os.environ.get("STEPS", "300"))
    stop_file = Path(os.environ["STOP_FILE"]) if os.environ.get("STOP_FILE") else None
    stopped_by = "steps"
    images, labels = load_digits()
    x, y = torch.tensor(images, dtype=torch.float32).flatten(1) / 16, torch.tensor(labels)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    seen = {key: os.environ.get(key) for key in ("DPWA_CONFIG", "DPWA_NAME", "DPWA_RUN_DIR", "DPWA_RESUME")}
    with dpwa.gossip_optimizer(opt, net, batch_size=32) as conn:
        xs, ys = x[conn.rank :: conn.world_size], y[conn.rank :: conn.world_size]
        for _ in range(steps):
            if stop_file is not None and stop_file.exists():
                stopped_by = "stop file"
                break
            batch = torch.randint(0, len(xs), (32,))
            loss = nn.functional.cross_entropy(net(xs[batch]), ys[batch])
            opt.zero_grad()
            loss.backward()
            conn.loss = loss
            opt.step()
    result = {"name": conn.name, "rank": conn.rank, "world_size": conn.world_size, "averaged": conn.averaged}
    result["stopped_by"] = stopped_by
    print("script-result " + json.dumps({**result, "env": seen}), flush=True)


if __name__ == "__main__":
    main()
