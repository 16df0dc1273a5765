# Sourced by test.sh: make sure iptables is there for the walkthrough's firewalled homes
# (tests/test_walkthrough.py, docs/operations.md "Nodes nobody can dial"). Installs Debian's iptables
# package once, quietly, when it is missing and this runs as root with apt-get; says so on stderr.
# Otherwise it changes nothing and the walkthrough is skipped with the reason.

if ! command -v iptables >/dev/null 2>&1; then
    source scripts/apt-install.sh
    apt_install iptables "the walkthrough's firewalls"
fi
