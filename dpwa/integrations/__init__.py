"""Integrations of dpwa with training frameworks; each is an optional extra, imported only when used.

* :mod:`dpwa.integrations.lightning`: ``DpwaCallback``, a Lightning callback (``pip install 'dpwa[lightning]'``);
* :mod:`dpwa.integrations.transformers`: ``DpwaTrainerCallback``, a Hugging Face ``TrainerCallback``
  (``pip install 'dpwa[transformers]'``);
* :mod:`dpwa.integrations.env`: which node this process is, from arguments or the environment
  (``node_from_env``), and keeping torchrun's variables from a framework that would start DDP (``hide_torchrun``);
* :mod:`dpwa.integrations.session`: the adapter's life inside a framework's hooks, shared by both callbacks.

This package imports nothing itself: ``import dpwa.integrations`` needs neither framework, nor torch.
See docs/integrations.md.
"""
