"""A two-layer GPT-2 trained by Hugging Face's Trainer with gossip under torchrun: each worker its own copy, no DDP.

    torchrun --standalone --nproc-per-node 2 examples/integrations/hf_tiny.py
    torchrun --standalone --nproc-per-node 2 examples/integrations/hf_tiny.py --steps 200 --out runs/hf
    torchrun --standalone --nproc-per-node 2 examples/integrations/hf_tiny.py --steps 30 --save-steps 30 --out runs/hf
    torchrun --standalone --nproc-per-node 2 examples/integrations/hf_tiny.py --steps 60 --resume --out runs/hf

The model is built from a config (``GPT2Config(n_layer=2, n_embd=64, ...)``),
never downloaded, and learns a synthetic language: sequences that count up by
a fixed stride modulo the vocabulary, each worker with its own sequences
(seeded by RANK). ``DpwaTrainerCallback`` is made BEFORE ``TrainingArguments``:
under torchrun it hides torchrun's variables from the Trainer, which would
otherwise start torch.distributed and wrap the model in DDP, so every worker
trains its own copy and dpwa averages them. At the end each worker prints one line

    dpwa-result {"name": "rank0", "averaged": 40, "first_loss": ..., "last_loss": ..., ...}

and, with ``--out DIR``, writes the same JSON to ``DIR/<name>.json``.
Needs ``pip install 'dpwa[transformers]'``; see docs/integrations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub; never reach for it
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from dpwa.integrations.transformers import DpwaTrainerCallback  # noqa: E402

HERE = Path(__file__).resolve().parent
VOCAB = 32
SEQ_LEN = 16


class Counting(Dataset):
    """Sequences start, start + stride, start + 2 stride, ... (mod VOCAB): learnable from two tokens on."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (size, 1), generator=g)
        stride = torch.randint(1, 4, (size, 1), generator=g)
        self.tokens = (start + stride * torch.arange(SEQ_LEN)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class AtStart(TrainerCallback):
    """Records what the worker trains from (after a resume: what it restored, and what dpwa's callback kept):
    the step, and sums of its weights and of its optimizer's state."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        assert model is not None
        self.seen = {"step": state.global_step, "weights": sum(float(p.double().sum()) for p in model.parameters())}
        if optimizer is not None and optimizer.state:
            self.seen["optimizer"] = sum(
                float(v.double().sum()) for s in optimizer.state.values() for k, v in s.items() if k == "exp_avg"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.environ.get("DPWA_CONFIG", str(HERE / "torchrun.yaml")))
    parser.add_argument("--name", default=None, help="this node's name (default: $DPWA_NAME, else torchrun's)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulate", type=int, default=1, help="TrainingArguments(gradient_accumulation_steps=N)")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): bf16 autocast")
    parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: none)")
    parser.add_argument("--resume", action="store_true", help="resume from the worker's own last checkpoint")
    parser.add_argument(
        "--out", type=Path, default=None, help="write DIR/<name>.json (and the Trainer's DIR/hf/<name>)"
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # one core per worker
    # First, before TrainingArguments: under torchrun it takes torchrun's variables out of the environment.
    # The defaults start the workers together and, at the end, keep a worker that finished first serving the
    # others' last exchanges (linger_s, 30 s at most: until no peer asked for 1 s).
    gossip = DpwaTrainerCallback(config=args.config, name=args.name)
    node = gossip.node
    torch.manual_seed(node.rank)  # different initial weights: at the start every worker takes rank 0's
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )
    out = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"dpwa-hf-tiny-{os.getuid()}"
    training = TrainingArguments(
        output_dir=str(out / "hf" / gossip.node_name),  # every worker is its own process 0: its own folder
        use_cpu=True,  # GPUs: leave it out; the callback gives each worker its own GPU
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate,  # the callback exchanges once per optimizer step
        bf16=args.bf16,
        learning_rate=args.lr,
        warmup_steps=5,
        logging_steps=1,  # every step's loss in log_history (and for the callback: the loss it reports)
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=node.rank,
    )
    trainer = Trainer(
        model=model, args=training, train_dataset=Counting(2048, seed=1000 + node.rank), callbacks=[gossip]
    )
    at_start = AtStart()  # after dpwa's callback: it sees what dpwa's start left
    trainer.add_callback(at_start)
    trainer.remove_callback(PrinterCallback)  # a line per step per worker is noise here; the losses are in log_history
    with gossip:  # the Trainer calls no callback on an exception: this closes the adapter whatever happens
        trainer.train(resume_from_checkpoint=True if args.resume else None)

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    stats = gossip.stats()
    assert gossip.adapter is not None
    result = {
        "name": gossip.adapter.name,
        # blends of this worker's parameters, in exchanges it started or served (mode symmetric moves both sides)
        "averaged": sum(peer.get("averaged", 0) for peer in stats.get("peers", {}).values()),
        "fetches_started": stats.get("fetches_started", 0),
        "fetches_ok": stats.get("fetches_ok", 0),
        "steps": trainer.state.global_step,  # optimizer steps
        "exchange_steps": gossip.session.steps,  # update_waits: one per optimizer step
        "bf16": training.bf16,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "stats": stats,
        "world_size": training.world_size,
        "parallel_mode": str(training.parallel_mode),
        "ddp": type(trainer.model_wrapped).__name__ != type(model).__name__,
        "distributed": torch.distributed.is_initialized(),
        "at_start": at_start.seen,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{result['name']}.json").write_text(json.dumps(result))
    print("dpwa-result " + json.dumps({k: v for k, v in result.items() if k not in ("losses", "stats")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
