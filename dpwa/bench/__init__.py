"""``python -m dpwa.bench``: dpwa's exchange against the raw floors it is built on (see :mod:`.measure`)."""
