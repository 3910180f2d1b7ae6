#!/usr/bin/env bash
# The GPU suite on a bare GPU machine whose python3 already has torch and triton (no venv, no
# network): install the wheels from .whl/ (deploy/gpu-wheels.sh) and the project into a private
# folder, then run `loraserve bench --suite gpu-check` with this script's arguments.
#     bash deploy/gpu-check.sh --out out/gpu-check
set -euo pipefail
cd "$(dirname "$0")/.."
SITE="${LORASERVE_SITE:-/tmp/loraserve-site}"
PY="${PYTHON:-python3}"
if [ ! -f "$SITE/.installed" ]; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run deploy/gpu-wheels.sh where pip can reach PyPI" >&2; exit 2; }
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" .
    touch "$SITE/.installed"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m loraserve.cli bench --suite gpu-check "$@"
