"""Which node this process is, from its arguments or its environment: the same answer for every integration.

A dpwa node needs a config and a name. Under torchrun (``nodes: torchrun``)
the name is torchrun's: ``rank<RANK>``, found by the adapter when it meets
the other workers (give None). Elsewhere it is the name of one entry of the
config's node list. :func:`node_from_env` resolves both, in this order:

* config: the ``config`` argument, else ``$DPWA_CONFIG``;
* name: the ``name`` argument, else ``$DPWA_NAME``, else None (the adapter
  then takes torchrun's ``rank<RANK>``; outside torchrun it raises
  :class:`~dpwa.config.ConfigError` asking for a name).

dpwa's launcher (``./run.sh -- python my_train.py``, ``python -m dpwa run``)
sets ``$DPWA_CONFIG`` and ``$DPWA_NAME`` for each node, and ``$DPWA_RUN_DIR``
(where the integrations write the node's metrics lines). The example's
``train.py`` takes ``--config FILE --name NAME`` on its command line instead.

Frameworks that take torchrun's variables as an order to start
``torch.distributed`` and wrap the model in DDP (Hugging Face's Trainer,
through accelerate) can be kept from doing so with :func:`hide_torchrun`: it
removes those variables from ``os.environ`` and returns them. The
:class:`NodeEnv` that :func:`node_from_env` returns keeps its own copy, and
:meth:`NodeEnv.torchrun_environment` puts them back for as long as the adapter
meets the other workers through torchrun's store.

:func:`node_from_env`, :class:`NodeEnv` and their constants live in
:mod:`dpwa.adapters.hook` (the optimizer hook resolves its node by the same
rule, and the adapters layer imports nothing from the integrations); they are
re-exported here. Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from ..adapters.hook import CONFIG_ENV, LINGER_S, NAME_ENV, TORCHRUN_VARIABLES, ConfigLike, NodeEnv, node_from_env

__all__ = [
    "CONFIG_ENV",
    "LINGER_S",
    "NAME_ENV",
    "TORCHRUN_VARIABLES",
    "ConfigLike",
    "NodeEnv",
    "hide_torchrun",
    "node_from_env",
]

_HIDDEN = TORCHRUN_VARIABLES[:10]  # what says "a distributed job"; the TORCHELASTIC_ ones are kept


def hide_torchrun(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Remove the variables that make a process a torchrun worker from the environment; return them.

    Call it after :func:`node_from_env` (whose result keeps its own copy) and
    before the framework reads them (for Hugging Face, before
    ``TrainingArguments`` is made). The removed variables are RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
    ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
    """
    env = os.environ if environ is None else environ
    return {key: env.pop(key) for key in _HIDDEN if key in env}
