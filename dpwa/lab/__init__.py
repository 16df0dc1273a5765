"""The lab: what dpwa is measured with and against, apart from the library

* :mod:`.systems`: the other ways to train one model on many workers (sync SGD with a master, parameter
  servers, all-reduce, DiLoCo);
* :mod:`.compare`: ``python -m dpwa.compare``, every system on the same workload;
* :mod:`.bench`: ``python -m dpwa.bench``, the transport and training overhead against raw floors;
* :mod:`.sim`: the mixing rules simulated in one process, without sockets;
* :mod:`.workloads`: the models and data the tools train (the embedded digits included).

The library (wire, runfiles, mixing, config, gossip, adapters, integrations, cluster) never imports it.
"""
