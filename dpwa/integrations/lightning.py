"""Gossip averaging for a Lightning ``Trainer``: one callback (``pip install 'dpwa[lightning]'``).

Example::

    import lightning as L
    from dpwa.integrations.lightning import DpwaCallback

    gossip = DpwaCallback(config="samples/torchrun.yaml")      # or $DPWA_CONFIG; name: $DPWA_NAME or torchrun's
    trainer = L.Trainer(accelerator="cpu", devices=1, callbacks=[gossip])   # one device, one process: no DDP
    trainer.fit(module, loader)
    print(gossip.stats()["averaged"])

The callback makes a :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`
over the LightningModule when fitting starts (``on_fit_start``: the model is
on its device), calls ``update_send`` at the start of each optimizer step's
first batch and ``update_wait`` with the batch's loss (``outputs``, or
``outputs["loss"]``) at the end of the batch after which the optimizer
stepped (``trainer.global_step`` rose): one exchange per optimizer step, so
with ``accumulate_grad_batches=N`` the parameters do not move between the N
batches whose gradients are summed. It closes
the adapter when fitting ends, at ``teardown``, or on an exception (each
path; closing twice is harmless).

Under torchrun every worker must train its own copy, with gossip in place of
DDP's gradient all-reduce: give the Trainer one device (``devices=1``, or
``devices=[LOCAL_RANK]`` on GPUs) and one node (the default), so that
Lightning picks ``SingleDeviceStrategy`` and starts no process group. The
callback refuses a Trainer whose strategy spans several processes (a
``RuntimeError`` at ``setup``). See docs/integrations.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .env import LINGER_S, ConfigLike, NodeEnv, node_from_env
from .session import AdapterSession

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # the extra is optional
    raise ImportError(
        f"dpwa.integrations.lightning needs Lightning ({exc}): pip install 'dpwa[lightning]' (or pip install lightning)"
    ) from exc

if TYPE_CHECKING:
    from ..adapters.pytorch import DpwaPyTorchAdapter

__all__ = ["DpwaCallback"]


class DpwaCallback(Callback):
    """Gossip averaging of a LightningModule's parameters, one exchange (at most) per optimizer step.

    Args:
        config: the dpwa config (a YAML path, a Config or parsed YAML); None: ``$DPWA_CONFIG``.
        name: this node's name in the config; None: ``$DPWA_NAME``, else torchrun's ``rank<RANK>``.
        linger_s: after the last batch, keep serving peers that still train for up to this long
            (``DpwaPyTorchAdapter.linger``: until no peer asked for 1 s); ``LINGER_S`` (30 s) by default; 0: close
            at once.
        **adapter_kwargs: passed to :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`
            (``include_buffers``, ``rng``, ``outer_optimizer``).
    """

    def __init__(
        self,
        config: ConfigLike | None = None,
        name: str | None = None,
        *,
        linger_s: float = LINGER_S,
        **adapter_kwargs: Any,
    ) -> None:
        super().__init__()
        self.node: NodeEnv = node_from_env(config, name)
        self.session = AdapterSession(self.node, adapter_kwargs, linger_s)
        self._sent_at = 0  # trainer.global_step when the open update_send was made

    @property
    def adapter(self) -> DpwaPyTorchAdapter | None:
        """The adapter (None before fitting starts); still readable after it closed."""
        return self.session.adapter

    def stats(self) -> dict[str, Any]:
        """The adapter's counters (``DpwaPyTorchAdapter.stats()``): live, or as they were when it closed."""
        return self.session.stats()

    @staticmethod
    def _check_one_process(trainer: pl.Trainer) -> None:
        if trainer.world_size > 1:
            raise RuntimeError(
                f"dpwa: the Trainer's strategy ({type(trainer.strategy).__name__}) spans {trainer.world_size} "
                "processes and would all-reduce gradients; gossip replaces that. Give each process one device "
                "(Trainer(devices=1), or devices=[LOCAL_RANK] on GPUs, num_nodes=1), so that each trains its own copy"
            )

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._check_one_process(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_one_process(trainer)
        resumed = trainer.ckpt_path is not None or trainer.global_step > 0  # fit(ckpt_path=...): its own state
        self.session.start(pl_module, resumed=resumed)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.session.pending:  # the first batch of an optimizer step (of several, when accumulating)
            self._sent_at = trainer.global_step
            self.session.send()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step > self._sent_at:  # the optimizer stepped after this batch: blend now
            self.session.wait(outputs)
        else:
            self.session.note_loss(outputs)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.close(linger=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.session.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.session.close()
