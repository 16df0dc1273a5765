"""One process of a comparison run: ``python -m dpwa_lab.compare.worker ROLE --run FILE --name NAME [--index I]``.

The runner starts these; a person does not need to. ROLE is one of
``gossip``, ``sync-master``, ``sync-worker``, ``ps-server``, ``ps-trainer``,
``allreduce`` and ``diloco`` (one rank each).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .roles import allreduce, diloco, gossip, ps, sync
from .roles.common import Role, load_role

ROLES: dict[str, tuple[Callable[[Role], None], bool]] = {  # role -> (entry, is a training worker)
    "gossip": (gossip.run, True),
    "sync-master": (sync.run_master, False),
    "sync-worker": (sync.run_worker, True),
    "ps-server": (ps.run_server, False),
    "ps-trainer": (ps.run_trainer, True),
    "allreduce": (allreduce.run_rank, True),
    "diloco": (diloco.run_rank, True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpwa_lab.compare.worker", description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--run", required=True, help="the run description (JSON) the runner wrote")
    parser.add_argument("--name", required=True)
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args(argv)
    entry, is_worker = ROLES[args.role]
    entry(load_role(args.run, args.name, args.index, worker=is_worker))
    return 0


if __name__ == "__main__":
    sys.exit(main())
