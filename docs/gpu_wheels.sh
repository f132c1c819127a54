#!/usr/bin/env bash
# The wheels docs/gpu_run.sh needs on the GPU machine (Python 3.12, x86-64), which has torch,
# numpy, matplotlib, pytest, pytest-xdist, hypothesis and transformers but not these (msgspec
# reads traces, expecttest gives torch's OpInfo samples to the autocast catalogue, docutils is
# imported by the tests of the questions' anchors). They land
# in .whl/ (ignored by git) and travel with the run.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>"$(git rev-parse --git-path info/exclude)"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "msgspec>=0.18" "expecttest>=0.2" "docutils>=0.20"
ls -l .whl
