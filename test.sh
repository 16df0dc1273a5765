#!/usr/bin/env bash
# Run the checks: sets up .venv from requirements.txt if needed (and, for the full run as root with apt-get,
# Debian's chromium for the dashboard's browser tests). Extra arguments go to pytest, e.g. ./test.sh -k config -x
#   ./test.sh            everything (what CI runs): ruff (lint, format) and mypy, then every test
#   ./test.sh --lint     ruff check, ruff format --check and mypy over dpwa/, tests/ and examples/; no test
#   ./test.sh --quick    the tests not marked slow (no lint): unit and one-process tests, about 6 minutes
#   ./test.sh --unit     the unit tests alone (no process, socket or sleep; tests/helpers/lanes.py): under a minute
# docs/testing.md says what each lane holds and what the full run may take.
set -euo pipefail
cd "$(dirname "$0")"
lane=full
case "${1:-}" in
    --lint | --quick | --unit) lane="${1#--}"; shift ;;
esac
started=$SECONDS
source scripts/ensure-venv.sh
phase() { echo "test.sh: $1 took $((SECONDS - started)) s" >&2; started=$SECONDS; }

lint() {
    echo "ruff check && ruff format --check && mypy" >&2
    "$PY" -m ruff check
    "$PY" -m ruff format --check
    "$PY" -m mypy
    phase "ruff and mypy"
}

case "$lane" in
    lint) lint ;;
    unit) exec "$PY" -m pytest -m "not slow and not io" "$@" ;;
    quick) exec "$PY" -m pytest -m "not slow" "$@" ;;
    full)
        phase ".venv"
        source scripts/ensure-chromium.sh
        lint
        # One worker: two (pytest-xdist, `./test.sh -n 2 --dist loadgroup`) were measured no faster on this
        # 2-core machine, whose suite is bound by its cores (docs/testing.md, 'Parallel workers').
        exec "$PY" -m pytest "$@"
        ;;
esac
