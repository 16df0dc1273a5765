"""``python -m dpwa.compare``: gossip, sync SGD with a master, async parameter servers, all-reduce and DiLoCo, side by side.

* :mod:`.workload`: the one model, data, shards, batch and schedule every system trains (digits, CIFAR-10, charlm);
* :mod:`.roles`, :mod:`.worker`: what each process of a run does;
* :mod:`.recorder`: the start gate, snapshots, timings and results a process writes;
* :mod:`.processes`, :mod:`.runner`: starting a run's processes, waiting, stopping them by PID;
* :mod:`.links`: slow links: each process in its own network namespace, its link shaped by tc;
* :mod:`.faults`: kills injected while a run trains;
* :mod:`.byzantine`: gossip workers that publish wrong snapshots (``--byzantine K --attack offset|flip``);
* :mod:`.evaluation`: which model is evaluated when, the same rule for every system;
* :mod:`.comparison`, :mod:`.report`: the whole comparison, and its table, JSON and PNG.
"""
