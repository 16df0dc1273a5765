"""Gossip averaging for a Hugging Face ``Trainer``: one callback (``pip install 'dpwa[transformers]'``).

Example::

    from transformers import Trainer, TrainingArguments
    from dpwa.integrations.transformers import DpwaTrainerCallback

    gossip = DpwaTrainerCallback(config="samples/torchrun.yaml")   # FIRST: before TrainingArguments (see below)
    args = TrainingArguments(output_dir=f"out/{gossip.node_name}", use_cpu=True, save_strategy="no", ...)
    with gossip:                                                     # closes the adapter, whatever happens
        Trainer(model=model, args=args, train_dataset=data, callbacks=[gossip]).train()
    print(gossip.stats()["averaged"])

The callback makes a :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`
over ``model`` in ``on_train_begin``, calls ``update_send`` in
``on_step_begin`` and ``update_wait`` in ``on_step_end`` (one optimizer step:
``gradient_accumulation_steps`` batches), and closes the adapter in
``on_train_end``. The Trainer calls no callback when training raises: use the
callback as a context manager (``with gossip:``), or call ``close()``; at
interpreter exit it closes anyway.

The loss: the Trainer's step hooks are not given the step's loss. The
callback keeps the last loss the Trainer logged (``on_log``, every
``logging_steps`` steps) and passes it to ``update_send`` and
``update_wait``; before the first log it passes None. It matters only to
``interpolation: loss`` and to the loss peers see in ``status``.

Under torchrun the Trainer (through accelerate) takes torchrun's variables
(LOCAL_RANK, WORLD_SIZE, ...) as an order to start ``torch.distributed`` and
wrap the model in DistributedDataParallel, and no ``TrainingArguments``
option turns that off. So, under torchrun, the constructor (with
``hide_torchrun=True``, the default) takes its copy of those variables and
removes them from ``os.environ`` (:func:`dpwa.integrations.env.hide_torchrun`):
a ``TrainingArguments`` made AFTER the callback sees a single process and
trains its own copy; the variables are put back only while the adapter meets
the other workers. On a machine with several GPUs it also gives each worker
its own GPU (``CUDA_VISIBLE_DEVICES``, by LOCAL_RANK), as the Trainer would
otherwise put every worker on GPU 0 and spread it over all GPUs with
DataParallel. ``on_train_begin`` raises ``RuntimeError`` if the Trainer is
distributed all the same (``TrainingArguments`` made before the callback).
See docs/integrations.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..logs import logger
from . import env as dpwa_env
from .env import LINGER_S, ConfigLike, NodeEnv, node_from_env
from .session import AdapterSession

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # the extra is optional
    raise ImportError(
        f"dpwa.integrations.transformers needs Hugging Face transformers ({exc}): "
        "pip install 'dpwa[transformers]' (transformers and accelerate)"
    ) from exc

if TYPE_CHECKING:
    from torch import nn

    from ..adapters.pytorch import DpwaPyTorchAdapter

__all__ = ["DpwaTrainerCallback"]


def _one_gpu_per_worker(local_rank: int) -> None:
    """With several GPUs visible and CUDA not yet initialized: make only the LOCAL_RANK-th one visible."""
    import torch

    if not torch.cuda.is_initialized() and torch.cuda.device_count() > 1:  # NVML: CUDA is not initialized
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)].strip()
    elif torch.cuda.is_initialized() and torch.cuda.device_count() > 1:
        logger.warning(
            "dpwa: CUDA was initialized before DpwaTrainerCallback: every worker sees every GPU; make the "
            "callback first, or set CUDA_VISIBLE_DEVICES per worker"
        )


class DpwaTrainerCallback(TrainerCallback):
    """Gossip averaging of a Trainer's model, one exchange (at most) per optimizer step.

    Args:
        config: the dpwa config (a YAML path, a Config or parsed YAML); None: ``$DPWA_CONFIG``.
        name: this node's name in the config; None: ``$DPWA_NAME``, else torchrun's ``rank<RANK>``.
        hide_torchrun: under torchrun, remove torchrun's variables from the environment now, so that a
            ``TrainingArguments`` made after this callback trains one process without DDP (the default).
        linger_s: after the last step, keep serving peers that still train for up to this long (until no peer
            asked for 1 s); ``LINGER_S`` (30 s) by default; 0: close at once.
        **adapter_kwargs: passed to :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`
            (``include_buffers``, ``rng``, ``outer_optimizer``).
    """

    def __init__(
        self,
        config: ConfigLike | None = None,
        name: str | None = None,
        *,
        hide_torchrun: bool = True,
        linger_s: float = LINGER_S,
        **adapter_kwargs: Any,
    ) -> None:
        self.node: NodeEnv = node_from_env(config, name)
        if hide_torchrun and self.node.under_torchrun:
            dpwa_env.hide_torchrun()
            _one_gpu_per_worker(self.node.local_rank)
        self.session = AdapterSession(self.node, adapter_kwargs, linger_s)

    @property
    def node_name(self) -> str:
        """This node's name as far as it is known before the start: the given name, else ``rank<RANK>``."""
        return self.node.name or f"rank{self.node.rank}"

    @property
    def adapter(self) -> DpwaPyTorchAdapter | None:
        """The adapter (None before training starts); still readable after it closed."""
        return self.session.adapter

    def stats(self) -> dict[str, Any]:
        """The adapter's counters (``DpwaPyTorchAdapter.stats()``): live, or as they were when it closed."""
        return self.session.stats()

    def close(self) -> None:
        """Close the adapter now (idempotent)."""
        self.session.close()

    def __enter__(self) -> DpwaTrainerCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if args.world_size > 1:
            raise RuntimeError(
                f"dpwa: the Trainer runs {args.world_size} processes with DistributedDataParallel "
                f"({args.parallel_mode}), whose gradient all-reduce gossip replaces: make DpwaTrainerCallback "
                "before TrainingArguments, so that the Trainer does not see torchrun's variables"
            )
        if model is None:
            raise RuntimeError("dpwa: the Trainer gave on_train_begin no model")
        self.session.start(model, resumed=state.global_step > 0)  # resume_from_checkpoint: its own state

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.send()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.session.wait(None)  # the step's loss is not given; the last logged one is the session's

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "loss" in logs:
            self.session.note_loss(logs["loss"])

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.close(linger=True)
