"""Workloads the tools train: models and data in pure torch and numpy, nothing of dpwa's wire.

* :mod:`.charlm`: a small GPT-style character-level transformer on the running
  interpreter's own standard library (or a text file of yours), with nothing to
  download. ``python -m dpwa.compare --workload charlm`` and
  ``./run.sh --workload charlm`` train it.
"""
