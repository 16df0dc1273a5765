#!/usr/bin/env bash
# Run the whole test suite: sets up .venv from requirements.txt if needed, then pytest.
# Extra arguments go to pytest, e.g. ./test.sh -k config -x
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure-venv.sh
exec "$PY" -m pytest "$@"
