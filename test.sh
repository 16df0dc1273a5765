#!/usr/bin/env bash
# Run every check: sets up .venv from requirements.txt if needed (and, as root with apt-get,
# Debian's chromium for the dashboard's browser test), then ruff (lint and format) and mypy
# on dpwa/, then pytest. Extra arguments go to pytest, e.g. ./test.sh -k config -x
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure-venv.sh
source scripts/ensure-chromium.sh
echo "ruff check dpwa && ruff format --check dpwa && mypy" >&2
"$PY" -m ruff check dpwa
"$PY" -m ruff format --check dpwa
"$PY" -m mypy
exec "$PY" -m pytest "$@"
