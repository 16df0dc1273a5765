#!/usr/bin/env bash
# Run every check: sets up .venv from requirements.txt if needed (and, as root with apt-get,
# Debian's chromium for the dashboard's browser test), then ruff (lint and format: dpwa/, tests/,
# examples/) and mypy (dpwa/ and tests/), then pytest. Extra arguments go to pytest, e.g. ./test.sh -k config -x
#   ./test.sh            everything (what CI runs)
#   ./test.sh --quick    the fast lane for the inner loop: the same checks, and the tests not marked slow
set -euo pipefail
cd "$(dirname "$0")"
quick=()
if [ "${1:-}" = "--quick" ]; then
    shift
    quick=(-m "not slow")
fi
source scripts/ensure-venv.sh
source scripts/ensure-chromium.sh
echo "ruff check && ruff format --check && mypy" >&2
"$PY" -m ruff check
"$PY" -m ruff format --check
"$PY" -m mypy
exec "$PY" -m pytest "${quick[@]}" "$@"
