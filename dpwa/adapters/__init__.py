"""Framework adapters: each turns a framework's model into a dpwa.mixing.params.FlatParams; lr schedules;
and an outer step by any torch optimizer (:mod:`.outer`)."""
