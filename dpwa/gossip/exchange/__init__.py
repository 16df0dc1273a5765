"""Exchanging: the symmetric exchange's protocol and driver, and the two mixing modes a node steps in.

* :mod:`.machine`: both halves of the symmetric exchange as a state machine without I/O (no zmq, socket,
  threading, select or time): events in, actions out; tested by deterministic simulation
  (tests/test_exchange_sim.py);
* :mod:`.driver`: the threads and sockets that drive the machine (tasks, halves, locks and the clock);
* :mod:`.steps`: the interface both modes implement (:class:`~.steps.Mode`) and what they work with;
  :mod:`.pull` and :mod:`.symmetric`: the two modes;
* :mod:`.guard`: a rule's halves applied under guard; :mod:`.outcomes`: how each request is counted;
  :mod:`.outer`: the outer step; :mod:`.progress`: the training thread's own numbers.

It builds on :mod:`dpwa.gossip.transfer` and :mod:`dpwa.gossip.membership`.
"""
