"""What both integrations do with the adapter: open it over a model, pair each send with a wait, close it once.

:class:`AdapterSession` is the framework-free part of
:class:`~dpwa.integrations.lightning.DpwaCallback` and
:class:`~dpwa.integrations.transformers.DpwaTrainerCallback`: it keeps the
node's identity (:class:`~dpwa.integrations.env.NodeEnv`), makes the
adapter (with torchrun's variables in the environment while it meets the
other workers), calls ``update_wait`` only after an ``update_send`` (and
waits out a send left open before the next one), and closes the adapter once,
whichever hook gets there first, or at interpreter exit if no hook does. The
counters are read once more as the adapter closes, so ``stats()`` still
answers after training. Under dpwa's launcher (``$DPWA_RUN_DIR`` set) the
nodes start together: each waits for the others at the ``start`` barrier
(at most :data:`START_WAIT_S`, as ``train.py`` does), so the one whose
imports finish first does not train alone; and it writes the node's metrics
lines as :func:`dpwa.gossip_optimizer` does (:mod:`dpwa.runfiles.metrics`):
the live table and the dashboard show the run.
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any

from ..adapters.pytorch import START_BARRIER, START_WAIT_S
from ..logs import logger
from ..runfiles.metrics import RUN_DIR_ENV, MetricsWriter, StepMetrics
from .env import NodeEnv

if TYPE_CHECKING:
    from torch import nn

    from ..adapters.pytorch import DpwaPyTorchAdapter
    from ..gossip.node import Update

__all__ = ["START_BARRIER", "START_WAIT_S", "AdapterSession", "loss_of", "resumed_config"]


def loss_of(value: Any) -> float | None:
    """A loss as a float: from a number, a 0-d tensor, or a mapping with "loss" (Lightning's outputs); else None."""
    if isinstance(value, dict):
        value = value.get("loss")
    if value is None:
        return None
    try:
        loss = float(value.detach().item() if hasattr(value, "detach") else value)
    except (TypeError, ValueError, RuntimeError):
        return None  # not one number (a tensor of several, a string): no loss
    return loss if math.isfinite(loss) else None


def resumed_config(config: Any) -> Any:
    """`config` (a path, parsed YAML or a Config) with ``join: never``: a worker that resumes from its own
    checkpoint keeps what it restored."""
    from ..gossip.setup import as_config

    parsed = as_config(config)
    return parsed if parsed.join == "never" else dataclasses.replace(parsed, join="never")


class AdapterSession:
    """One adapter over one model, for the length of one training run."""

    def __init__(self, node: NodeEnv, adapter_kwargs: dict[str, Any], linger_s: float = 0.0) -> None:
        self.node = node
        self.adapter_kwargs = dict(adapter_kwargs)
        self.linger_s = float(linger_s)
        self.adapter: DpwaPyTorchAdapter | None = None
        self.model: nn.Module | None = None  # the model the adapter blends (its final state is saved at the end)
        self.last_loss: float | None = None  # the last loss seen, given to the next update_send
        self.last_update: Update | None = None
        self.final_stats: dict[str, Any] | None = None  # stats() as the adapter closed
        self._pending = False  # an update_send not yet followed by its update_wait
        self._closed = False
        self.steps = 0  # update_waits made: the steps of the metrics lines
        self.metrics: StepMetrics | None = None  # the run folder's metrics lines, under dpwa's launcher

    @property
    def open(self) -> bool:
        return self.adapter is not None and not self._closed

    @property
    def pending(self) -> bool:
        """Is an update_send waiting for its update_wait?"""
        return self._pending

    def start(self, model: nn.Module, resumed: bool = False) -> DpwaPyTorchAdapter:
        """Make the adapter over `model` (idempotent while open: a second call returns the first adapter).

        `resumed`: the framework restored `model` and its optimizer from this worker's own checkpoint
        (``resume_from_checkpoint``, ``ckpt_path``). The node then starts with ``join: never`` whatever the
        config says: a donor's weights would replace the restored ones while the optimizer state stayed this
        worker's (under torchrun every rank but 0 used to take rank 0's weights so).

        RuntimeError once the session has closed (the end of a ``train()`` or ``fit()``): a second run with the
        same callback would otherwise train alone in silence, its node closed."""
        if self._closed:
            raise RuntimeError(
                f"dpwa: this callback's node ({self.node.name or 'rank' + str(self.node.rank)}) closed at the end of "
                "the last train()/fit(); make a new callback for another run (a closed node is not reopened)"
            )
        if self.adapter is not None:
            return self.adapter
        from ..adapters.pytorch import DpwaPyTorchAdapter

        with self.node.torchrun_environment():  # a torchrun config is read with torchrun's variables in place
            config = resumed_config(self.node.config) if resumed else self.node.config
            if resumed:
                logger.info(
                    "dpwa: %s resumes from its own checkpoint: join: never for this start (its weights and "
                    "optimizer state both come from the checkpoint)",
                    self.node.name or f"rank{self.node.rank}",
                )
            self.adapter = DpwaPyTorchAdapter(model, self.node.name, config, **self.adapter_kwargs)
        self.model = model
        atexit.register(self.close)  # a run that ends with no closing hook still closes its sockets
        run_dir = os.environ.get(RUN_DIR_ENV)
        if self.node.waits_at_start(resumed):
            self.adapter.start_together(START_WAIT_S)
        if run_dir:
            adapter = self.adapter
            self.metrics = StepMetrics(MetricsWriter(run_dir, adapter.name), adapter.stats)
            joined = adapter.joined
            rejoined = joined is not None and joined.rejoined
            self.metrics.start(
                started=f"joined the cluster from {joined.donor}" if rejoined else "started from the beginning",
                rank=adapter.rank,
                world_size=adapter.world_size,
                clock=adapter.clock,
            )
        return self.adapter

    def send(self, batch_size: float = 1) -> bool:
        """update_send before a batch (after waiting out a send left open); False when not open."""
        if not self.open:
            return False
        assert self.adapter is not None
        if self._pending:
            self.wait(None)
        self._pending = True
        return self.adapter.update_send(self.last_loss, batch_size)

    def note_loss(self, loss: Any) -> None:
        """Remember a loss (a logged one) for the next update_send; None, NaN and the like are ignored."""
        value = loss_of(loss)
        if value is not None:
            self.last_loss = value

    def wait(self, loss: Any) -> Update | None:
        """update_wait after a batch, with its loss (None: unknown); None when no send is open."""
        value = loss_of(loss)
        self.note_loss(value)
        if not self.open or not self._pending:
            return None
        assert self.adapter is not None
        self._pending = False
        self.last_update = self.adapter.update_wait(value)
        self.steps += 1
        if self.metrics is not None:
            self.metrics.step(self.steps, value, self.last_update)
        return self.last_update

    def close(self, linger: bool = False) -> None:
        """Close the adapter (idempotent). `linger`: first serve peers still training, up to ``linger_s``."""
        if not self.open:
            return
        assert self.adapter is not None
        adapter = self.adapter
        try:
            if self._pending:
                self.wait(None)
            if linger and self.linger_s > 0:
                adapter.linger(idle_s=min(1.0, self.linger_s), limit_s=self.linger_s)
        finally:
            self._closed = True  # once, even if closing fails
            atexit.unregister(self.close)
            try:
                adapter.close()
            finally:
                self.final_stats = adapter.stats()
                if linger and self.metrics is not None:
                    self._save_final(adapter.name)
                if self.metrics is not None:
                    try:
                        self.metrics.step(self.steps, None, self.last_update, force=True)
                        self.metrics.end("done" if linger else "closed", self.final_stats, step=self.steps)
                    finally:
                        self.metrics.writer.close()

    def _save_final(self, name: str) -> None:
        """Under dpwa's launcher, at the end of training: the node's final weights as the run folder's ``last``
        checkpoint (``{"model": state_dict}``), so ``python -m dpwa average RUN_DIR`` gives the mean model of a
        callback run as of ``train.py``'s. A checkpoint that cannot be written is logged, not raised."""
        from ..runfiles import checkpoints

        run_dir = os.environ.get(RUN_DIR_ENV)
        if not run_dir or self.model is None:
            return
        try:
            path = checkpoints.save(run_dir, checkpoints.LAST, name, {"model": self.model.state_dict()})
        except (checkpoints.CheckpointError, OSError, ValueError) as exc:
            logger.error("%s: final weights not saved: %s", name, exc)
            return
        logger.info("%s: final weights in %s (python -m dpwa average %s gives the mean model)", name, path, run_dir)

    def stats(self) -> dict[str, Any]:
        """The adapter's counters: live while open, as they were at close after; {} before the start."""
        if self.final_stats is not None:
            return self.final_stats
        return self.adapter.stats() if self.adapter is not None else {}
