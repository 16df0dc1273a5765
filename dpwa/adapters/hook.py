"""Gossip from an unchanged training loop: one call at the optimizer; and which node this process is.

Example::

    import dpwa

    with dpwa.gossip_optimizer(opt, net) as conn:   # config: $DPWA_CONFIG; name: $DPWA_NAME or torchrun's
        for inputs, targets in loader:
            loss = loss_fn(net(inputs), targets)
            opt.zero_grad()
            loss.backward()
            conn.loss = loss       # optional: the loss peers see, and ``interpolation: loss``
            opt.step()             # then: finish this step's exchange, start the next one

:func:`gossip_optimizer` makes a :class:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter`
over the model and registers a step post-hook on the optimizer
(``Optimizer.register_step_post_hook``). The first ``update_send`` is made on
entry; after each ``optimizer.step()`` the hook calls ``update_wait`` (blending
in the peer's parameters the exchange fetched during the forward and backward
pass) and then ``update_send`` (publishing the stepped parameters and starting
the next exchange, which overlaps the next batch). Leaving the block, on every
path, removes the hook and closes the adapter; on a normal exit the exchange
started after the last step is waited for (and blended) first.

Which node: :func:`node_from_env` (also used by the Lightning and Hugging
Face callbacks, which reach it through :mod:`dpwa.integrations.env`) resolves
the config and the name from the arguments or the environment:

* config: the ``config`` argument, else ``$DPWA_CONFIG``;
* name: the ``name`` argument, else ``$DPWA_NAME``, else None (the adapter
  then takes torchrun's ``rank<RANK>``; outside torchrun it raises
  :class:`~dpwa.config.ConfigError` asking for a name).

Nothing here imports torch: the adapter is imported when a block is entered,
so ``dpwa.integrations.env`` stays free of torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import Config, ConfigError
from ..gossip.exchange.progress import loss_value
from ..logs import logger
from ..runfiles.metrics import RUN_DIR_ENV, MetricsWriter, StepMetrics

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..gossip.node import Update
    from .pytorch import DpwaPyTorchAdapter

__all__ = [
    "CONFIG_ENV",
    "NAME_ENV",
    "LINGER_S",
    "TORCHRUN_DEFAULTS",
    "TORCHRUN_VARIABLES",
    "ConfigLike",
    "GossipHook",
    "NodeEnv",
    "gossip_optimizer",
    "node_from_env",
]

#: what the adapter takes as its config: a YAML path, a parsed Config, or parsed YAML data
ConfigLike = str | os.PathLike[str] | Config | Mapping[str, Any]

CONFIG_ENV = "DPWA_CONFIG"  # the config file, when the config argument is not given
NAME_ENV = "DPWA_NAME"  # the node's name, when the name argument is not given

#: How long a node that finished keeps serving peers that still train, by default (gossip_optimizer and the
#: callbacks): it stops once no peer has asked for 1 s, so a node whose peers are done too closes within a
#: second; before (0), the last exchanges of the peers still training were answered `closing`.
LINGER_S = 30.0

#: The config of a torchrun worker given none (no config argument, no $DPWA_CONFIG): what samples/torchrun.yaml
#: holds (a test keeps the two the same). The node list comes from torchrun's rendezvous.
TORCHRUN_DEFAULTS: Mapping[str, Any] = {
    "nodes": "torchrun",
    "interface": "auto",
    "fetch_probability": 1,
    "timeout_ms": 2500,
    "rule": "delta",
}

#: What torchrun (torch.distributed.run) sets for each worker. The first ten say "a distributed job" to
#: accelerate, Lightning and torch.distributed, and are what ``dpwa.integrations.env.hide_torchrun`` removes; the
#: TORCHELASTIC_ ones (the run's id and restart round, which dpwa's rendezvous names its keys by) are kept as well.
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)


@dataclass(frozen=True)
class NodeEnv:
    """A node's config and name, and torchrun's variables as they were when it was resolved.

    ``name`` None: the adapter takes torchrun's ``rank<RANK>``. ``torchrun``
    is empty outside torchrun.
    """

    config: str | Config | Mapping[str, Any]
    name: str | None
    torchrun: Mapping[str, str] = field(default_factory=dict)

    @property
    def under_torchrun(self) -> bool:
        return "RANK" in self.torchrun and "WORLD_SIZE" in self.torchrun

    def waits_at_start(self, resumed: bool = False) -> bool:
        """Does the node wait for its peers at the start barrier before its first step
        (``DpwaPyTorchAdapter.start_together``)? Under dpwa's launcher (``$DPWA_RUN_DIR``), as torchrun's workers
        start together. Under torchrun only when `resumed` from its own checkpoint: a fresh node's join lines it
        up with rank 0, a resumed one (``join: never``) joins nobody, and the rank that restored its checkpoint
        first would train alone until the other's node is up."""
        if self.under_torchrun:
            return resumed
        return bool(os.environ.get(RUN_DIR_ENV))

    @property
    def rank(self) -> int:
        """This node's index, known before training starts: torchrun's RANK; else its name's index in the
        config's node list (dpwa's launcher: w1 is 0, w2 is 1, ...); 0 when neither says (open membership)."""
        if self.under_torchrun:
            return int(self.torchrun["RANK"])
        return self._placement[0]

    @property
    def world_size(self) -> int:
        """The number of nodes, known before training starts: torchrun's WORLD_SIZE; else the config's node
        list's length (with open membership, whose members come and go, 1)."""
        if self.under_torchrun:
            return int(self.torchrun["WORLD_SIZE"])
        return self._placement[1]

    @functools.cached_property
    def _placement(self) -> tuple[int, int]:
        """(index, count) of this node in the config's node list; (0, 1) without a name or a fixed list."""
        from ..gossip.setup import as_config

        if self.name is None:
            return 0, 1
        config = as_config(self.config)
        names = [node.name for node in config.nodes] if config.nodes and not config.bootstrap else []
        return (names.index(self.name), len(names)) if self.name in names else (0, 1)

    def shard(self, data: Any) -> Any:
        """This node's shard of `data` (anything with ``len`` and indexing: a Dataset, a list): the items
        ``rank, rank + world_size, ...``, as a ``torch.utils.data.Subset``. The nodes' shards are disjoint
        and cover `data` under every launcher (:attr:`rank`, :attr:`world_size`); hand the shard to the
        Trainer or the DataLoader, which then shuffles within it."""
        from torch.utils.data import Subset

        return Subset(data, range(self.rank, len(data), self.world_size))

    @property
    def local_rank(self) -> int:
        """torchrun's LOCAL_RANK (0 outside torchrun): which of this machine's workers this is."""
        return int(self.torchrun.get("LOCAL_RANK", "0"))

    @contextlib.contextmanager
    def torchrun_environment(self, environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
        """Within the block, torchrun's variables (as captured) are in the environment; as they were after.

        The adapter reads them from ``os.environ`` to meet the other workers;
        a variable already set is left as it is.
        """
        env = os.environ if environ is None else environ
        added = [key for key in self.torchrun if key not in env]
        for key in added:
            env[key] = self.torchrun[key]
        try:
            yield
        finally:
            for key in added:
                env.pop(key, None)


def node_from_env(
    config: ConfigLike | None = None,
    name: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> NodeEnv:
    """Which node this process is: ``config`` or ``$DPWA_CONFIG``; ``name`` or ``$DPWA_NAME`` or None.

    ``config`` is anything the adapter takes (a YAML path, a Config, parsed YAML data).
    Given neither, a torchrun worker takes :data:`TORCHRUN_DEFAULTS` (and logs that it did); outside
    torchrun that is a ConfigError naming both ways to give one. The name is not checked
    here: the adapter checks it against the config (and, under torchrun,
    against torchrun's).
    """
    env = os.environ if environ is None else environ
    found: str | Config | Mapping[str, Any]
    if config is None:
        found = env.get(CONFIG_ENV, "")
    elif isinstance(config, os.PathLike):
        found = os.fspath(config)
    else:
        found = config
    if isinstance(found, str) and not found and under_torchrun(env):
        found = dict(TORCHRUN_DEFAULTS)
        logger.info(
            "dpwa: no config given (no config argument, %s unset): a torchrun worker, so the torchrun defaults "
            "(as samples/torchrun.yaml): %s",
            CONFIG_ENV,
            ", ".join(f"{k}: {v}" for k, v in TORCHRUN_DEFAULTS.items()),
        )
    if isinstance(found, str) and not found:
        raise ConfigError(
            f"no dpwa config: pass config=FILE, or set {CONFIG_ENV}=FILE (under torchrun, none is needed: the "
            "torchrun defaults of samples/torchrun.yaml apply)"
        )
    if name is None:
        name = env.get(NAME_ENV) or None
    return NodeEnv(found, name, {key: env[key] for key in TORCHRUN_VARIABLES if key in env})


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Is this process a torchrun worker (its variables say so)?"""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class GossipHook:
    """What ``with gossip_optimizer(...) as conn`` gives: the adapter, and what the hook sends with each step.

    Set ``loss`` (a number or a 0-d tensor; a tensor is read once, after the
    step) before ``optimizer.step()`` to report the step's loss: the hook
    passes it to ``update_wait`` as this step's loss and to the next
    ``update_send``. It keeps its last value until set again (None: unknown;
    only ``interpolation: loss``, ``divergence_threshold`` and what peers
    report use it). ``batch_size`` is what each step adds to the clock
    (``update_send``'s ``batch_size``); it may be changed between steps and
    applies from the next exchange started.
    """

    def __init__(
        self,
        adapter: DpwaPyTorchAdapter,
        optimizer: torch.optim.Optimizer,
        batch_size: float,
        metrics: StepMetrics | None = None,
    ) -> None:
        self.adapter = adapter
        self.optimizer = optimizer
        self.loss: Any = None
        self.batch_size = batch_size
        self.steps = 0  #: optimizer steps the hook has seen
        self.last_update: Update | None = None  #: what the last ``update_wait`` did (None before the first step)
        self._pending = False  # an update_send not yet followed by its update_wait
        self._handle: Any = None
        self.metrics = metrics  #: the run folder's metrics lines (dpwa.runfiles.metrics), if written
        self._ended: str | None = None  # the reason of the metrics' end line, once known

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def rank(self) -> int:
        """This node's index in the config's node list (under torchrun: torchrun's RANK)."""
        return self.adapter.rank

    @property
    def world_size(self) -> int:
        """The number of nodes in the config's node list (under torchrun: torchrun's WORLD_SIZE)."""
        return self.adapter.world_size

    @property
    def clock(self) -> float:
        return self.adapter.clock

    @property
    def averaged(self) -> int:
        """How many times this node's parameters were blended with a peer's: the exchanges it started and,
        in mode symmetric, the halves it applied for peers' (the sum of ``stats()["peers"][...]["averaged"]``)."""
        return sum(int(peer.get("averaged", 0)) for peer in self.stats().get("peers", {}).values())

    def stats(self) -> dict[str, Any]:
        """The adapter's counters (``DpwaPyTorchAdapter.stats``): live, and as they were at close after."""
        return self.adapter.stats()

    def _loss(self) -> float | None:
        value = loss_value(self.loss)
        self.loss = value  # a tensor is read once; its graph is let go
        return value

    def _send(self) -> None:
        self.adapter.update_send(self.loss, self.batch_size)
        self._pending = True

    def _wait(self, loss: float | None) -> None:
        if self._pending:
            self._pending = False
            self.last_update = self.adapter.update_wait(loss)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        loss = self._loss()
        self._wait(loss)
        if self.metrics is not None:
            self.metrics.step(self.steps, loss, self.last_update)
        self._send()

    def _attach(self) -> None:
        if self.metrics is not None:
            joined = self.adapter.joined
            started = (
                f"joined the cluster from {joined.donor}"
                if joined is not None and joined.rejoined
                else "started from the beginning"
            )
            self.metrics.start(started=started, rank=self.rank, world_size=self.world_size, clock=self.clock)
        self._handle = self.optimizer.register_step_post_hook(self._after_step)
        self._send()

    def _finish(self, linger_s: float) -> None:
        """A normal exit: wait for the exchange started after the last step; serve peers for up to `linger_s`."""
        self._wait(self._loss())
        if self.metrics is not None:
            self.metrics.step(self.steps, None, self.last_update, force=True)  # the steps since the last line
        if linger_s > 0:
            if self.metrics is not None:
                self.metrics.writer.write("linger", limit_s=linger_s)
            self.adapter.linger(idle_s=min(1.0, linger_s), limit_s=linger_s)
        self._ended = "done"

    def _close(self) -> None:
        """Every exit: remove the hook, then close the adapter (an exchange still pending is abandoned)."""
        handle, self._handle = self._handle, None
        try:
            if handle is not None:
                handle.remove()
        finally:
            self._pending = False
            try:
                self.adapter.close()
            finally:
                if self.metrics is not None:
                    try:
                        self.metrics.end(self._ended or "stopped by an exception", step=self.steps)
                    finally:
                        self.metrics.writer.close()


@contextlib.contextmanager
def gossip_optimizer(
    optimizer: torch.optim.Optimizer,
    net: nn.Module,
    /,
    config: ConfigLike | None = None,
    name: str | None = None,
    *,
    batch_size: float = 1,
    linger_s: float = LINGER_S,
    metrics: bool | None = None,
    log_every: int = 5,
    **adapter_kwargs: Any,
) -> Iterator[GossipHook]:
    """Within the block, every ``optimizer.step()`` also gossips `net`'s parameters with the other nodes.

    Args:
        optimizer: the optimizer of the loop; a step post-hook is registered on it for the block's length.
            It is also given to the adapter (``optimizer=``), so that a node that joins a trained cluster
            takes its donor's optimizer state too (``optimizer=None`` among the keyword arguments: not).
        net: the model whose parameters (and floating-point buffers) are blended in place.
        config: a YAML path, a :class:`~dpwa.config.Config` or parsed YAML data; None: ``$DPWA_CONFIG``.
        name: which node of the config this is; None: ``$DPWA_NAME``, else torchrun's ``rank<RANK>``.
        batch_size: what each step adds to the node's clock (``update_send``'s ``batch_size``): the default 1
            counts optimizer steps; give the batch size to count samples (``conn.batch_size`` may change it).
        linger_s: on a normal exit, keep serving peers that still train for up to this long
            (``DpwaPyTorchAdapter.linger``: until no peer asked for 1 s); :data:`LINGER_S` by default; 0: close
            at once.
        metrics: write the node's metrics lines (``start``, a ``step`` line every `log_every` steps, ``end``:
            :mod:`dpwa.runfiles.metrics`) into ``$DPWA_RUN_DIR``, so the launcher's live table, ``status``,
            the dashboard and ``curves.png`` show this script; None (the default): when ``$DPWA_RUN_DIR`` is set
            (``python -m dpwa run`` sets it); False: never.
        log_every: steps between ``step`` lines.
        adapter_kwargs: the adapter's other keyword arguments (``include_buffers``, ``rng``, ``outer_optimizer``).

    Yields a :class:`GossipHook`: ``loss`` and ``batch_size`` to set, ``rank``, ``world_size``, ``name``,
    ``clock``, ``averaged``, ``stats()``, ``last_update``, and ``adapter`` for everything else (barriers,
    checkpoints, ``linger``).

    Under dpwa's launcher (``$DPWA_RUN_DIR`` set, not torchrun) the node first waits for the others at the
    ``start`` barrier (:meth:`~dpwa.adapters.pytorch.DpwaPyTorchAdapter.start_together`, at most 60 s), as
    torchrun's workers start together. The first ``update_send`` is made on entry; after each step, ``update_wait`` and the next ``update_send``.
    On a normal exit the last exchange is waited for (its ``update_wait``: the clock counts one step's
    ``batch_size`` more than the steps made, as the send after the last step counts its batch); on every exit
    the hook is removed and the adapter closed, before the block's exception, if any, goes on.
    """
    node = node_from_env(config, name)
    run_dir = os.environ.get(RUN_DIR_ENV) or None if metrics is not False else None
    if metrics and run_dir is None:
        raise ConfigError(f"gossip_optimizer(metrics=True): ${RUN_DIR_ENV} (the run folder to write into) is not set")
    if log_every < 1:
        raise ValueError(f"gossip_optimizer: log_every={log_every}, expected 1 or more (steps between metrics lines)")
    from .pytorch import DpwaPyTorchAdapter

    kwargs = {"optimizer": optimizer, **adapter_kwargs}
    with node.torchrun_environment():
        adapter = DpwaPyTorchAdapter(net, node.name, node.config, **kwargs)
    try:
        steps = StepMetrics(MetricsWriter(run_dir, adapter.name), adapter.stats, log_every) if run_dir else None
    except BaseException:
        adapter.close()
        raise
    hook = GossipHook(adapter, optimizer, batch_size, steps)
    try:
        if node.waits_at_start():
            adapter.start_together()
        hook._attach()
        yield hook
        hook._finish(linger_s)
    finally:
        hook._close()
