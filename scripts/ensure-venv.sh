# Sourced by run.sh and test.sh: make sure .venv exists and holds requirements.txt.
# Re-installs only when requirements.txt, pyproject.toml or lab/pyproject.toml changed since the last install.
# The library and its lab (lab/, the distribution dpwa-lab) are both installed editable from the checkout.
# After sourcing, $PY is the virtual environment's python.

_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="$_root/.venv"
PY="$_venv/bin/python"

_stamp_of() {
    cat "$_root/requirements.txt" "$_root/pyproject.toml" "$_root/lab/pyproject.toml" | sha256sum | cut -d' ' -f1
}

if [ ! -x "$PY" ]; then
    echo "dpwa: creating $_venv" >&2
    python3 -m venv "$_venv" || { echo "dpwa: python3 -m venv failed (Python >= 3.10 with venv is needed)" >&2; exit 1; }
fi
if [ "$(cat "$_venv/.dpwa-stamp" 2>/dev/null)" != "$(_stamp_of)" ]; then
    echo "dpwa: installing requirements.txt into $_venv (first run takes a few minutes)" >&2
    # --no-compile, then compileall on every core: pip byte-compiles one file after another (41 s of a
    # fresh install's 86 s here); compileall -j 0 does the same on all cores (28 s on two). Some packages ship
    # files for newer Pythons that do not compile (torch's py312_intrinsics.py); pip skips those silently, so
    # does this (-qq, and its status is not checked).
    "$PY" -m pip install --quiet --disable-pip-version-check --no-compile -r "$_root/requirements.txt" \
        || { echo "dpwa: pip install -r requirements.txt failed; see the messages above" >&2; exit 1; }
    "$PY" -m compileall -qq -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$_root" \
        || { echo "dpwa: pip install -e . failed; see the messages above" >&2; exit 1; }
    # the lab after the library it depends on (--no-deps: its dependencies are requirements.txt's)
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e "$_root/lab" \
        || { echo "dpwa: pip install -e lab failed; see the messages above" >&2; exit 1; }
    _stamp_of > "$_venv/.dpwa-stamp"
fi
