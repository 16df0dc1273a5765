"""What each process of a comparison run does, one module per system.

Every role reads the run description (JSON, written by the runner), sets up
(data, model, sockets), waits at the start gate (:func:`..recorder.wait_for_go`),
trains, and writes its snapshots and results (:class:`..recorder.Recorder`).
``python -m dpwa_lab.compare.worker ROLE --run FILE --name NAME [--index I]`` runs one.
"""
