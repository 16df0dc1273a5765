"""Moving snapshots: the node's message kinds, its published snapshots, serving and requesting them, joins.

* :mod:`.protocol`: the node's message kinds, and the bounds every number from a peer must meet;
* :mod:`.snapshots`: published snapshots, their slots and leases;
* :mod:`.serving`: the Rx side, answering fetches; :mod:`.requesting`: the Tx side, fetching and checking replies;
* :mod:`.validation`: the checks a peer's parameters must pass before anyone blends them;
* :mod:`.join`: a starting node takes the cluster's state from a peer; :mod:`.extras`: the optimizer's and
  the rule's state that travels with it.

It builds on :mod:`dpwa.gossip.membership` (who may ask, and the digests snapshots carry).
"""
