# Sourced by test.sh: make sure headless Chromium is there for the dashboard's browser test
# (tests/test_dashboard.py). Installs Debian's chromium package once, quietly, when it is missing
# and this runs as root with apt-get; says so on stderr. Otherwise it changes nothing and the
# browser tests are skipped with the reason. DPWA_NO_CHROMIUM=1 skips the install.

if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "${DPWA_NO_CHROMIUM:-}" = 1 ]; then
        echo "dpwa: DPWA_NO_CHROMIUM=1: the dashboard's browser tests will be skipped" >&2
    else
        source scripts/apt-install.sh
        apt_install chromium "the dashboard's browser tests"
    fi
fi
