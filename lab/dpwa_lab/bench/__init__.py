"""``python -m dpwa.bench``: dpwa's exchange against the raw floors it is built on (see :mod:`.cli`).

* :mod:`.cli`: the command: what it measures, its options, the whole run;
* :mod:`.children`: the helper processes (``--serve-...``), started and stopped by PID, and the log they share;
* :mod:`.floors`: the raw floors: a memory copy, ZeroMQ and TCP round trips, and the helpers that serve them;
* :mod:`.exchange`: dpwa between two processes, and a raw client of a dpwa node;
* :mod:`.sizes`: each model size's table, every floor and every dpwa path sampled in turn;
* :mod:`.training`: a training step with and without dpwa, against its floors;
* :mod:`.scale`: many nodes as threads in one process;
* :mod:`.memory`: two training nodes in processes of their own: what each holds beyond its model;
* :mod:`.blends`: the same two nodes: how often they average, by model size and step time;
* :mod:`.flaky`: a delaying, cutting proxy, and three nodes behind it (issue 50's flaky link);
* :mod:`.report`: the machine, the tables and the summary.
"""
