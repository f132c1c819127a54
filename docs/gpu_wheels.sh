#!/usr/bin/env bash
# The wheels docs/gpu_run.sh needs on the GPU machine (Python 3.12, x86-64), which has torch,
# numpy, matplotlib, pytest, pytest-xdist, hypothesis and transformers but not these. They land
# in .whl/ (ignored by git) and travel with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>"$(git rev-parse --git-path info/exclude)"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "msgspec>=0.18"
ls -l .whl
