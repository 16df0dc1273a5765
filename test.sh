#!/usr/bin/env bash
# Run the checks: sets up .venv from requirements.txt if needed (and, for the full run as root with apt-get,
# Debian's chromium for the dashboard's browser tests). Extra arguments go to pytest, e.g. ./test.sh -k config -x
#   ./test.sh            everything (what CI runs): every test on two workers, ruff (lint, format) and mypy beside them
#   ./test.sh --lint     ruff check, ruff format --check and mypy over dpwa/, tests/ and examples/; no test
#   ./test.sh --quick    the tests not marked slow (no lint): unit and one-process tests, about 6 minutes
#   ./test.sh --unit     the unit tests alone (no process, socket or sleep; tests/helpers/lanes.py), on two workers:
#                        under a minute
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
    unit) exec "$PY" -m pytest -n 2 -m "not slow and not io" "$@" ;; # both cores: the simulations are CPU-bound
    quick) exec "$PY" -m pytest -m "not slow" "$@" ;;
    full)
        phase ".venv"
        source scripts/ensure-chromium.sh
        source scripts/ensure-iptables.sh
        # The checks run beside the tests, on the core the tests leave idle (mypy is one core's work for about
        # a minute); their output follows pytest's. Two workers (pytest-xdist; tests/helpers/workers.py says how
        # the tests are handed out): docs/testing.md, 'Parallel workers'. Extra -n N overrides, -n 0 is one process.
        lint_log=$(mktemp)
        set -m # the checks in a process group of their own, which the trap stops if the tests end first
        (started=$SECONDS; lint) > "$lint_log" 2>&1 &
        lint_pid=$!
        set +m
        trap 'kill -- "-$lint_pid" 2>/dev/null || true; rm -f "$lint_log"' EXIT
        tests=0
        "$PY" -m pytest -n 2 "$@" || tests=$?
        checks=0
        wait "$lint_pid" || checks=$?
        cat "$lint_log" >&2
        [ "$checks" -eq 0 ] || echo "test.sh: ruff or mypy failed (exit $checks): see above" >&2
        [ "$tests" -ne 0 ] && exit "$tests"
        exit "$checks"
        ;;
esac
