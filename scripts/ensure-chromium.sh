# Sourced by test.sh: make sure headless Chromium is there for the dashboard's browser test
# (tests/test_dashboard.py). Installs Debian's chromium package once, quietly, when it is missing
# and this runs as root with apt-get; says so on stderr. Otherwise it changes nothing and the
# browser tests are skipped with the reason. DPWA_NO_CHROMIUM=1 skips the install.

if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "${DPWA_NO_CHROMIUM:-}" = 1 ]; then
        echo "dpwa: DPWA_NO_CHROMIUM=1: the dashboard's browser tests will be skipped" >&2
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "dpwa: installing Debian's chromium for the dashboard's browser test (once; apt-get install chromium)" >&2
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1; then
            DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 \
                || echo "dpwa: apt-get install chromium failed; the dashboard's browser tests will be skipped" >&2
        fi
    else
        echo "dpwa: chromium is not installed (and this is not root with apt-get): the dashboard's browser" \
             "tests will be skipped; apt-get install chromium to run them" >&2
    fi
fi
