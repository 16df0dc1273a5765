# Sourced by test.sh: make sure iptables is there for the walkthrough's firewalled homes
# (tests/test_walkthrough.py, docs/operations.md "Nodes nobody can dial"). Installs Debian's iptables
# package once, quietly, when it is missing and this runs as root with apt-get; says so on stderr.
# Otherwise it changes nothing and the walkthrough is skipped with the reason.

if ! command -v iptables >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "dpwa: installing Debian's iptables for the walkthrough's firewalls (once; apt-get install iptables)" >&2
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null 2>&1; then
            DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null 2>&1 \
                || echo "dpwa: apt-get install iptables failed; the walkthrough will be skipped" >&2
        fi
    else
        echo "dpwa: iptables is not installed (and this is not root with apt-get): the walkthrough" \
             "will be skipped; apt-get install iptables to run it" >&2
    fi
fi
