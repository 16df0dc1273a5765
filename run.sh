#!/usr/bin/env bash
# Start a local dpwa training cluster: one node per core (at least 2), live progress, then a summary.
# Sets up .venv from requirements.txt first if needed. All options: ./run.sh --help
#   ./run.sh                      train the example on this machine, in the foreground (Ctrl-C stops it)
#   ./run.sh --nodes 4 --epochs 5
#   ./run.sh --detach             leave it in the background; ./stop.sh stops it
#   ./run.sh --nodes 4 -- python my_train.py --lr 0.1
#                                 your own script instead, once per node (python -m dpwa run --help)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure-venv.sh
for arg in "$@"; do
    if [ "$arg" = "--" ]; then
        exec "$PY" -m dpwa run "$@"
    fi
done
exec "$PY" examples/pytorch-cifar/cluster.py "$@"
