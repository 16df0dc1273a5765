"""The gossip node, in layers that point down: membership < transfer < exchange < the node.

tests/test_layers.py holds them:

* :mod:`.membership`: who the members are and whom to ask (the view, barriers, flow control, relays);
* :mod:`.transfer`: the node's message kinds, snapshots, serving and requesting them, joins;
* :mod:`.exchange`: the exchange's state machine and its driver, and the two mixing modes;
* the node that assembles them: :mod:`.node` (the :class:`Node` facade), :mod:`.services` (its sockets,
  threads and slots, built in order and closed in reverse), :mod:`.setup` and :mod:`.start` (who it is, and
  how it starts), :mod:`.settings` (the mixing objects a config names) and :mod:`.reporting` (stats and status).
"""

from .node import Node, Update

__all__ = ["Node", "Update"]
