#!/usr/bin/env bash
# The project's whole test run (what `make test` and CI run): sets up the
# Python environment and the testbed binaries (cached outside the repo), lints,
# type-checks, then runs unit, integration, trainer and end-to-end tests.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/unit -k placement
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=$(scripts/bootstrap.sh trainer | tail -n 1)
bin=$(testbed/build.sh | tail -n 1)
export PATH="$venv/bin:$bin:$PATH"
# This checkout's code first: the cached venv is shared by every checkout on the machine.
export PYTHONPATH="$root/operator:$root/trainer_image:$root${PYTHONPATH:+:$PYTHONPATH}"
# mypy analyses torch on a cold cache (minutes): keep its cache with the other builds.
export MYPY_CACHE_DIR=${MYPY_CACHE_DIR:-${TOPOTRAIN_CACHE:-$HOME/.cache/topotrain}/mypy}
echo "== ruff"
ruff check operator trainer_image tests bench testbed scripts
echo "== mypy --strict"
mypy --strict operator/topotrain trainer_image/topotrain_trainer
echo "== pytest"
set +e
# The default run is every suite, the bounded chaos soak (tests/chaos, about 6 minutes) included;
# the kind suite (tests/kind) skips itself unless scripts/kind-e2e.sh made a cluster.
[ $# -eq 0 ] && set -- tests
python -m pytest "$@"
code=$?
set -e
# pytest exit 5 means it collected nothing: that is a failure here, not a pass.
[ $code -eq 5 ] && { echo "pytest ran no tests" >&2; exit 1; }
exit $code
