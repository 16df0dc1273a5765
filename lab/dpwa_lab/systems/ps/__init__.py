"""Asynchronous parameter servers (Jin et al. 2016; Dean et al. 2012), over dpwa's transport.

* :mod:`.sharding`: which server holds which variable, balanced by size (pure);
* :mod:`.messages`: the kinds (pull, push, status);
* :mod:`.blocks`: one block's values, optimizer, version, queue and applier thread;
* :mod:`.server`: a parameter server: one shard, one queue and one applier per block;
* :mod:`.iopool`, :mod:`.trainer`: a trainer's IO threads, and its fetch / push steps.
"""
