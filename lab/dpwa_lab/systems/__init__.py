"""The other ways to train one model on many workers, next to gossip, for comparison.

Jin et al. 2016 ("How to scale distributed deep learning?") compare gossip
with two systems that keep one global model; dpwa implements both over its own
transport (:mod:`dpwa.wire`: msgpack headers declared per kind, raw tensor
frames, CURVE, no pickle), plus the exact reference:

* :mod:`.sync`: synchronous SGD with a master. The master keeps the global
  model, its version and three task queues (todo, doing, done); workers get a
  task (a data segment), and for each minibatch update their model if it is
  out of date, compute gradients and report them. Reports for an old version
  are refused; once enough gradients for the current version arrived the
  master takes an optimizer step. A task held by a worker that stops calling
  returns to todo after a lease.
* :mod:`.ps`: asynchronous parameter servers. Parameters are sharded over K
  servers, balanced by size; each server applies the gradients of each block
  one at a time, as they arrive, through one queue per block, and records
  their staleness. Trainers fetch the latest parameters before the forward
  pass and send gradients from an IO thread pool.
* :mod:`.allreduce`: ``DistributedDataParallel`` over gloo, launched with
  ``torch.multiprocessing`` (or rank by rank): every worker applies the exact mean gradient.
* :mod:`.diloco`: DiLoCo (Douillard et al. 2023) over gloo: H local steps, then
  an all-reduce of the pseudo-gradient and an outer Nesterov step
  (:mod:`dpwa.mixing.outer`).

The pieces every system shares: the model seen as named variables in one flat
order and the checks received values pass (:mod:`.layout`), the optimizer over
flat vectors (:mod:`.optim`); the transport claims ipc endpoints for a
service's lifetime itself. ``python -m dpwa.compare`` runs them all, and
gossip, on the same model, data and machine.
"""
