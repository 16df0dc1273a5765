"""Tools that run dpwa clusters; they use the library, the library never uses them.

* :mod:`.launch`: start, watch and stop one process per node (what ``./run.sh`` runs);
* :mod:`.processes`: free ports, PID files, node processes;
* :mod:`.monitor`: the live table and the summary, from the nodes' metrics files;
* :mod:`.events`: the launcher's event log (events.jsonl), and a bounded reader of JSON-lines files;
* :mod:`.plot`: a run's curves;
* :mod:`.status`: every node's status over the wire (``python -m dpwa status``);
* :mod:`.observe` and :mod:`.dashboard`: the live web page (``python -m dpwa dashboard``);
* :mod:`.checkpoints`, :mod:`.keys`: checkpoints of a run; CURVE keys for a config.
* :mod:`dpwa.runfiles.private` (a layer below): a run folder is this user's alone (folders 0700, files 0600, whatever the umask).
"""
