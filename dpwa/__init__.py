"""dpwa: decentralized training by pairwise gossip averaging over ZeroMQ.

``DpwaPyTorchAdapter`` wraps a PyTorch training loop; :class:`~dpwa.gossip.node.Node`
is the framework-agnostic core over one flat numpy buffer.

The package, by layer:

* ``dpwa.wire``: the transport (wire format, chunked payloads, server, clients, bulk streams, CURVE,
  endpoints, shared memory);
* ``dpwa.mixing``: pure math (the model as a flat vector, kernels, interpolation, mixing rules, wire codecs,
  pairing schedules);
* ``dpwa.gossip``: the gossip node, split by concern;
* ``dpwa.adapters``: framework adapters (PyTorch), the optimizer hook, and learning-rate schedules driven by the
  cluster's clock;
* ``dpwa.integrations``: Lightning and Hugging Face callbacks (optional extras);
* ``dpwa.cluster``: tools that run clusters (launcher, processes, monitor, plot, checkpoints, status);
* ``dpwa.compare``, ``dpwa.bench``, ``dpwa.sim``: launchers of the lab's commands (:mod:`dpwa.labcommand`).

The lab is a distribution of its own, ``dpwa-lab`` (the package ``dpwa_lab``, in the repository's ``lab/``
folder: the other training systems on the same transport, the comparison, the benchmark, the simulator and the
workloads). It imports the library; the library never imports it.
"""

from __future__ import annotations

from typing import Any

from .adapters.hook import GossipHook, gossip_optimizer
from .adapters.schedule import ClockSchedule, step_decay
from .config import Config, ConfigError, load_config, parse_config
from .gossip.membership.barrier import BarrierTimeout
from .gossip.node import Node, Update
from .mixing.params import FlatParams, NumpyParams
from .wire.errors import TransportError

__version__ = "0.2.0"

__all__ = [
    "BarrierTimeout",
    "ClockSchedule",
    "Config",
    "ConfigError",
    "DpwaPyTorchAdapter",
    "FlatParams",
    "GossipHook",
    "Node",
    "NumpyParams",
    "TransportError",
    "Update",
    "gossip_optimizer",
    "load_config",
    "parse_config",
    "step_decay",
]


def __getattr__(name: str) -> Any:
    # torch is imported only by those who use the PyTorch adapter.
    if name == "DpwaPyTorchAdapter":
        from .adapters.pytorch import DpwaPyTorchAdapter

        return DpwaPyTorchAdapter
    raise AttributeError(f"module 'dpwa' has no attribute {name!r}")
