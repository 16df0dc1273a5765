"""The gossip node, split by concern (see :mod:`.node` for how the parts fit).

* :mod:`.node`: the :class:`Node` facade and its training-thread API;
* :mod:`.messages`: the node's message kinds;
* :mod:`.snapshots`: published snapshots and their leases;
* :mod:`.serving`: the Rx side, answering fetches;
* :mod:`.requesting`: the Tx side, fetching and checking replies;
* :mod:`.exchange_machine`: symmetric exchanges' protocol, both halves, as state machines without I/O;
* :mod:`.exchange`: the driver of those machines (requests, snapshots, locks, the clock);
* :mod:`.flow`: flow control (whom to ask);
* :mod:`.validation`: the checks a peer's parameters must pass.
"""

from .node import Node, Update

__all__ = ["Node", "Update"]
