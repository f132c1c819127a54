#!/usr/bin/env bash
# Run gallery pages as plain scripts on a GPU machine: their assertions then check what the
# hardware does. The whole gallery runs inside the site build (`bash docs/gpu_site.sh`, which
# records each page's output); this is for a page or two again, after a fix, in seconds:
# `bash docs/gpu_pages.sh [PAGE...]` (default: every examples/*/plot_*.py; outputs in $OUT,
# default build/gpu_run; JOBS pages at a time, default 8; at most 240 s a page).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_run}
mkdir -p "$OUT/pages"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 MPGUIDE_RECORDED="$PWD/docs/recorded"
export PYTHONPATH="$PWD:$PWD/docs${PYTHONPATH:+:$PYTHONPATH}"
source docs/gpu_env.sh
pages=${*:-$(ls examples/*/plot_*.py)}
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
