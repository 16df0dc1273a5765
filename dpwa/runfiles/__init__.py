"""What a node and its launcher write into a run folder: private files, and the metrics lines every tool reads

:mod:`.private` makes the folders and files this user's alone; :mod:`.metrics` is the writer of the
metrics lines, checked by :mod:`.lines`. Below the adapters, so that the optimizer hook writes metrics
itself; above nothing but the base.
"""
