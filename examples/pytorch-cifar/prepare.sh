#!/usr/bin/env bash
# Download CIFAR-10 (python version), check its MD5 and unpack it where the example looks for it.
#   examples/pytorch-cifar/prepare.sh        into examples/pytorch-cifar/data/cifar-10-batches-py
#   examples/pytorch-cifar/prepare.sh DIR    into DIR/cifar-10-batches-py (then: ./run.sh --data-dir DIR/cifar-10-batches-py)
# Without internet here: fetch cifar-10-python.tar.gz on another machine, copy it into the
# data folder (examples/pytorch-cifar/data/ or DIR) and run this again: it verifies and unpacks it.
# CIFAR10_URL and CIFAR10_MD5 select a mirror and its checksum.
set -euo pipefail

url="${CIFAR10_URL:-https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz}"
md5="${CIFAR10_MD5:-c58f30108f718f92721af3b95e74349a}"
case "${1:-}" in -h|--help) sed -n '2,7s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
dir="${1:-$(cd "$(dirname "$0")" && pwd)/data}"
archive="$dir/cifar-10-python.tar.gz"
target="$dir/cifar-10-batches-py"
files="data_batch_1 data_batch_2 data_batch_3 data_batch_4 data_batch_5 test_batch"

prepared() {
    local f
    for f in $files; do [ -f "$target/$f" ] || return 1; done
}
if prepared; then
    echo "prepare.sh: CIFAR-10 is already prepared in $target"
    exit 0
fi
mkdir -p "$dir"

if [ ! -f "$archive" ]; then
    echo "prepare.sh: downloading $url (163 MB)"
    if command -v curl >/dev/null; then
        fetch=(curl -fL --connect-timeout 20 --retry 2 -o "$archive.part" "$url")
    elif command -v wget >/dev/null; then
        fetch=(wget --timeout=20 -O "$archive.part" "$url")
    else
        fetch=(python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$url" "$archive.part")
    fi
    if ! "${fetch[@]}"; then
        rm -f "$archive.part"
        echo "prepare.sh: cannot download $url (no internet access from here?)." >&2
        echo "  Download it on a machine that has access, copy it to $archive," >&2
        echo "  and run $0${1:+ $1} again: it checks the MD5 and unpacks it." >&2
        echo "  Meanwhile ./run.sh trains on the embedded digits." >&2
        exit 1
    fi
    mv "$archive.part" "$archive"
fi

if command -v md5sum >/dev/null; then
    actual="$(md5sum "$archive" | cut -d' ' -f1)"
elif command -v md5 >/dev/null; then
    actual="$(md5 -q "$archive")"
else
    actual="$(python3 -c 'import hashlib, sys; print(hashlib.md5(open(sys.argv[1], "rb").read()).hexdigest())' "$archive")"
fi
if [ "$actual" != "$md5" ]; then
    echo "prepare.sh: $archive has MD5 $actual, expected $md5:" >&2
    echo "  the download is damaged or is not CIFAR-10. Delete it and run prepare.sh again." >&2
    exit 1
fi
echo "prepare.sh: MD5 verified ($md5)"

tar -xzf "$archive" -C "$dir" cifar-10-batches-py
if ! prepared; then
    echo "prepare.sh: $archive unpacked, but $target lacks some of: $files" >&2
    exit 1
fi
echo "prepare.sh: CIFAR-10 is ready in $target; ./run.sh now trains on it"
