#!/usr/bin/env bash
# The site's recorded measurements on a lent GPU machine, in one call of at most 9 minutes: the
# second call of docs/publishing.md's procedure (the first, `bash docs/gpu_site.sh`, builds the
# whole site there and records every example's output).
#
# On the GPU machine (Python 3.12, torch with CUDA, no network): `bash docs/gpu_run.sh`. The
# packages it lacks travel as wheels in .whl/ (made here by `bash docs/gpu_wheels.sh`,
# installed by docs/gpu_env.sh). Outputs
# land in $OUT (default build/gpu_run): the recording (docs/recorded/), the GPU tests' log, one
# training step's CUDA trace (tests/data/gpu/), the model report's benchmark (docs/benchmarks/)
# with a profile of one report (.prof, .txt), diff's benchmark beside DebugMode (diff_cuda.json,
# with a profile where a goal is missed), and the provenance of the run. Rehearse it on a
# CPU with `bash docs/gpu_run.sh --allow-cpu`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_run}
mkdir -p "$OUT"
allow=()
[[ "${1:-}" == "--allow-cpu" ]] && allow=(--allow-cpu)
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source docs/gpu_env.sh
status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start))s; log: $OUT/$name.log"
  tail -n 5 "$OUT/$name.log"
  [[ $rc -eq 0 ]] || status=1
}
step provenance 60 "$PY" -c "
import platform, subprocess, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', platform.python_version())
if torch.cuda.is_available():
    print('gpu', torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability())
    print(subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total',
                          '--format=csv,noheader'], capture_output=True, text=True).stdout)
"
step record 240 "$PY" docs/site_recordings.py --out "$OUT" --trace "$OUT/train_step_cuda.json.gz" "${allow[@]}"
step gpu_tests 120 "$PY" -m pytest -m gpu -n 0 -q -p no:cacheprovider tests
dev=cuda
[[ ${#allow[@]} -gt 0 ]] && dev=cpu
step model_report 90 "$PY" benchmarks/model_report.py --device "$dev" --repeat 5 \
  --out "$OUT/model_report_$dev.json" --profile "$OUT/model_report_$dev.prof"
only=()  # the CPU rehearsal times the stand-in only: the 12-layer model takes minutes there
[[ $dev == cpu ]] && only=(--only stand-in)
step diff_bench 90 "$PY" benchmarks/diff.py --device "$dev" --repeat 3 "${only[@]}" \
  --out "$OUT/diff_$dev.json"
cat "$OUT/provenance.log"
exit $status
