"""Framework adapters: each turns a framework's model into a :class:`dpwa.mixing.params.FlatParams`."""
