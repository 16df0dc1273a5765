"""Framework adapters: each turns a framework's model into a dpwa.mixing.params.FlatParams; and lr schedules."""
