#!/usr/bin/env bash
# Run, as plain scripts on a GPU machine, the gallery pages that take another path on a GPU
# (those that test for CUDA): their assertions then check what the hardware does. Called by
# docs/gpu_run.sh; alone: `bash docs/gpu_pages.sh [PAGE...]` (outputs in $OUT, default build/gpu_run; JOBS
# pages at a time, default 8).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_run}
mkdir -p "$OUT/pages"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 MPGUIDE_RECORDED="$PWD/docs/recorded"
export PYTHONPATH="$PWD:$PWD/docs${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
pages=${*:-$(grep -lE 'type == "cuda"|device\.LIVE|cuda\.is_available' examples/*/plot_*.py)}
run() {  # one page, at most 240 s; prints "exit seconds page"
  local start=$SECONDS log
  log="$OUT/pages/$(basename "$(dirname "$1")")_$(basename "$1" .py).log"
  timeout 240 "$PY" "$1" >"$log" 2>&1
  echo "$? $((SECONDS - start))s $1"
}
export -f run
export OUT PY
printf '%s\n' $pages | xargs -P "${JOBS:-8}" -I{} bash -c 'run {}' | sort -k3 | tee "$OUT/pages.txt"
tar -czf "$OUT/pages.tar.gz" -C "$OUT" pages && rm -r "$OUT/pages"
! grep -qv '^0 ' "$OUT/pages.txt"
