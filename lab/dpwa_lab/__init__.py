"""The lab: what dpwa is measured with and against, apart from the library

A distribution of its own, ``dpwa-lab`` (this folder, ``lab/`` in the repository), so that ``pip install dpwa``
installs none of it. From a checkout: ``pip install -e . -e lab``.

* :mod:`.systems`: the other ways to train one model on many workers (sync SGD with a master, parameter
  servers, all-reduce, DiLoCo);
* :mod:`.compare`: ``python -m dpwa_lab.compare`` (or ``python -m dpwa.compare``, ``dpwa-compare``), every system
  on the same workload;
* :mod:`.bench`: ``python -m dpwa_lab.bench`` (``python -m dpwa.bench``, ``dpwa-bench``), the transport and
  training overhead against raw floors;
* :mod:`.sim`: ``python -m dpwa_lab.sim`` (``python -m dpwa.sim``, ``dpwa-sim``), the mixing rules simulated in
  one process, without sockets;
* :mod:`.workloads`: the models and data the tools train (the embedded digits included, ``data/``).

The lab imports the library (wire, runfiles, mixing, config, gossip, adapters, cluster); the library never imports
the lab (``python -m dpwa.compare`` and the others find it by name when they start: ``dpwa/labcommand.py``).
"""
