#!/usr/bin/env bash
# Download the wheels a bare GPU machine needs (deploy/gpu-wheels.txt) into .whl/, for CPython 3.12
# on x86-64 Linux. Run here, where the package registry is reachable; carry .whl/ to the GPU machine
# and run deploy/gpu-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${PYVER:-3.12}"
rm -rf .whl && mkdir -p .whl
grep -v '^#' deploy/gpu-wheels.txt | while read -r requirement; do
    [ -n "$requirement" ] || continue
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d .whl "$requirement"
done
echo "$(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
