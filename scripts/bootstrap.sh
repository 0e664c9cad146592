#!/usr/bin/env bash
# Creates (once) the project's Python environment, cached outside the repo
# under $TOPOTRAIN_CACHE keyed by the Python version and constraints.txt, then
# installs this checkout into it. Prints the venv path on the last line.
#   scripts/bootstrap.sh            operator + dev tools
#   scripts/bootstrap.sh trainer    also torch (large, cached once)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${TOPOTRAIN_CACHE:-$HOME/.cache/topotrain}
py=${PYTHON:-python3}
pyver=$($py -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$(cat "$root/constraints.txt" | sha256sum | cut -c1-12)
venv="$cache/venv-py$pyver-$key"
extras="dev"
[ "${1:-}" = trainer ] && extras="dev,trainer"
marker="$venv/.installed-$extras"
if [ ! -f "$marker" ]; then
  echo "[bootstrap] creating $venv ($extras)" >&2
  [ -x "$venv/bin/python" ] || $py -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -U pip >&2
  "$venv/bin/pip" install -q --disable-pip-version-check -c "$root/constraints.txt" "$root[$extras]" >&2
  touch "$marker"
fi
# The checkout moves between clones: always (re)link this one, without deps.
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" >&2 2>/dev/null \
  || "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -e "$root" >&2
echo "$venv"
