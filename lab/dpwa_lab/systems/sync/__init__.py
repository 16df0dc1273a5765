"""Synchronous SGD with a master (Jin et al. 2016), over dpwa's transport.

* :mod:`.master`: the master's state, pure: task queues with leases, model version, step rule;
* :mod:`.model`: the master's global model (the optimizer over flat vectors);
* :mod:`.messages`: one request kind per call (GetTask, UpdateModelIfOutOfDate, ReportGradients, ReportTask);
* :mod:`.service`: the master behind a :class:`dpwa.wire.server.Server`;
* :mod:`.client`, :mod:`.worker`: a worker's calls, and its loop.
"""
