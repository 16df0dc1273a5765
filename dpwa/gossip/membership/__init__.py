"""Who the members are, and whom to ask: the lowest layer of the gossip node.

* :mod:`.view`: open membership's view, pure (no sockets, threads or clock): its rules alone;
* :mod:`.messages`: the view's message kinds (a member's entry, a digest, ``members``);
* :mod:`.members`: the view's threaded owner on a node, and the ``members`` call;
* :mod:`.refresh`: asking a bootstrap address again while no member is there;
* :mod:`.rendezvous`: ``nodes: torchrun``, the node list from torchrun's store;
* :mod:`.relayed`: who a node's relay admits, and its own way in when nobody can dial it;
* :mod:`.barrier`: named barriers without a master;
* :mod:`.flow`: flow control, which peer to ask next; :mod:`.deadlines`: each peer's request time.
"""
