"""A tiny LightningModule trained by gossip under torchrun: each worker its own copy, no DDP.

    torchrun --standalone --nproc-per-node 2 examples/integrations/lightning_tiny.py
    torchrun --standalone --nproc-per-node 2 examples/integrations/lightning_tiny.py --epochs 5 --out runs/lightning

A two-layer perceptron on the handwritten digits shipped with dpwa's lab (nothing
is downloaded); each worker trains on its own shard (RANK of WORLD_SIZE) and
averages with the others through dpwa (``DpwaCallback``). The Trainer gets one
device, so Lightning runs ``SingleDeviceStrategy`` in every worker and starts
no process group. At the end each worker prints one line

    dpwa-result {"name": "rank0", "averaged": 71, "first_loss": ..., "last_loss": ..., "test_acc": ..., ...}

and, with ``--out DIR``, writes the same JSON to ``DIR/<name>.json``.
Needs ``pip install 'dpwa[lightning]'``; see docs/integrations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpwa.integrations.lightning import DpwaCallback
from dpwa.signals import stop_on_signals
from dpwa_lab.workloads.digits import load_digits

HERE = Path(__file__).resolve().parent
TEST_ROWS = 297  # the last rows of the digits: a test set every worker evaluates on


class TinyNet(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr = lr
        self.losses: list[float] = []  # every training batch's loss, for the result line

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss  # the callback reads it from `outputs` at the batch's end

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def digits(rank: int, world: int) -> tuple[TensorDataset, TensorDataset]:
    """This worker's training shard, and the common test set."""
    images, labels = load_digits()
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels)
    train_x, train_y = x[:-TEST_ROWS], y[:-TEST_ROWS]
    return TensorDataset(train_x[rank::world], train_y[rank::world]), TensorDataset(x[-TEST_ROWS:], y[-TEST_ROWS:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.environ.get("DPWA_CONFIG", str(HERE / "torchrun.yaml")))
    parser.add_argument("--name", default=None, help="this node's name (default: $DPWA_NAME, else torchrun's)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=N)")
    parser.add_argument("--precision", default="32-true", help="Trainer(precision=...): bf16-mixed, say")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/<name>.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one core per worker
    # The defaults start the workers together and, at the end, keep a worker that finished first serving the
    # others' last exchanges (linger_s, 30 s at most: until no peer asked for 1 s)
    gossip = DpwaCallback(config=args.config, name=args.name)
    node = gossip.node
    torch.manual_seed(node.rank)  # different initial weights: at the start every worker takes rank 0's
    train_set, test_set = digits(node.rank, node.world_size)
    model = TinyNet(args.lr)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,  # one device per process: SingleDeviceStrategy, no process group, no DDP (GPUs: [LOCAL_RANK])
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,  # the callback exchanges once per optimizer step
        precision=args.precision,
        callbacks=[gossip],
        logger=False,
        enable_checkpointing=False,  # every worker is its own rank 0 to Lightning: give each its own folder to save
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(args.out / f"rank{node.rank}") if args.out else None,
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    with stop_on_signals():  # torchrun's SIGTERM unwinds: Lightning's on_exception closes the adapter
        trainer.fit(model, loader)

    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        test_acc = float((model(x).argmax(1) == y).float().mean())
    stats = gossip.stats()
    assert gossip.adapter is not None
    result = {
        "name": gossip.adapter.name,
        # blends of this worker's parameters, in exchanges it started or served (mode symmetric moves both sides)
        "averaged": sum(peer.get("averaged", 0) for peer in stats.get("peers", {}).values()),
        "fetches_started": stats.get("fetches_started", 0),
        "fetches_ok": stats.get("fetches_ok", 0),
        "steps": len(model.losses),  # training batches
        "optimizer_steps": trainer.global_step,
        "exchange_steps": gossip.session.steps,  # update_waits: one per optimizer step
        "precision": str(trainer.precision),
        "first_loss": model.losses[0],
        "last_loss": model.losses[-1],
        "losses": model.losses,
        "stats": stats,
        "test_acc": test_acc,
        "strategy": type(trainer.strategy).__name__,
        "distributed": torch.distributed.is_initialized(),
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{result['name']}.json").write_text(json.dumps(result))
    print("dpwa-result " + json.dumps({k: v for k, v in result.items() if k not in ("losses", "stats")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
