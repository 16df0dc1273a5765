# Sourced by scripts/ensure-*.sh: apt_install PACKAGE WHAT installs Debian's PACKAGE once, quietly, as root with
# apt-get (updating the lists once if the first try fails), and says so on stderr; elsewhere it says that WHAT
# will be skipped. It never fails the caller.

apt_install() {
    local package=$1 what=$2
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "dpwa: installing Debian's $package for $what (once; apt-get install $package)" >&2
        if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null 2>&1; then
            DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || true
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null 2>&1 \
                || echo "dpwa: apt-get install $package failed; $what will be skipped" >&2
        fi
    else
        echo "dpwa: $package is not installed (and this is not root with apt-get): $what will be skipped;" \
             "apt-get install $package first" >&2
    fi
}
