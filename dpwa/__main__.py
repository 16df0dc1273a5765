"""``python -m dpwa``: the command line (see dpwa.cli)."""

import sys

from .cli import main

sys.exit(main())
