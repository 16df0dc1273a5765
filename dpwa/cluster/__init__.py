"""Tools that run dpwa clusters; they use the library, the library never uses them.

* :mod:`.launch`: start, watch and stop one process per node (what ``./run.sh`` runs);
* :mod:`.processes`: free ports, PID files, node processes;
* :mod:`.monitor`: the live table and the summary, from the nodes' metrics files;
* :mod:`.plot`: a run's curves.
"""
