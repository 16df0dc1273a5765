"""Framework adapters: each turns a framework's model into a dpwa.mixing.params.FlatParams; lr schedules;
an outer step by any torch optimizer (:mod:`.outer`); and gossip from an unchanged loop, one call at the
optimizer (:mod:`.hook`: ``gossip_optimizer``).

Importing this package imports no torch: :mod:`.hook` imports the PyTorch adapter when a block is entered.
"""

from .hook import GossipHook, gossip_optimizer

__all__ = ["GossipHook", "gossip_optimizer"]
