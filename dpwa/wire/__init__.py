"""The transport every dpwa service runs on: nothing here knows what a model is.

* :mod:`.messages`: the wire format (msgpack headers declared per kind, raw payload frames);
* :mod:`.server`: a ROUTER thread that dispatches request kinds to handlers, within a budget per client;
* :mod:`.client`: Lazy-Pirate channels and the client thread that runs tasks on them;
* :mod:`.curve`: CURVE keys and key files;
* :mod:`.certs`: member certificates, a cluster key's consent that a node may join (open membership);
* :mod:`.endpoints`: addresses, the user's private directory, ipc endpoints;
* :mod:`.shm`: same-host shared-memory slots for bulk payloads.
"""
