#!/usr/bin/env bash
# The whole site built on a lent GPU machine in one call, every example run there, and the
# gallery's GPU output brought home (docs/publishing.md).
#
# On the GPU machine (Python 3.12, torch with CUDA, 16 cores, no network), from the repository
# root with .whl/ carried (made here by `bash docs/gpu_wheels.sh`): `bash docs/gpu_site.sh`.
# It installs the docs and test dependencies from .whl/ into a virtual environment that sees
# the machine's torch, builds the site with -W, sphinx-gallery running one example per core
# (the notebook pages beside them, docs/early_notebooks.py) and carrying on past a failing
# example, then harvests what the gallery printed and drew (docs/gallery_recordings.py).
# Outputs, under $OUT (default build/gpu_site):
#   gallery/<gpu>.json            the manifest: provenance; every example's status, seconds, device
#   gallery/<gpu>/<chapter>/...   each code block's output and the figures (palette PNGs)
#   build.log, times.txt          Sphinx's log; per-example seconds, longest first, per chapter
#   html.tar.gz                   the built site, with --keep-html
# Copy gallery/ to docs/recorded/gallery/ here. Rehearse on a CPU with --allow-cpu (outputs
# to /tmp/gpu_site_rehearsal unless OUT is set; never docs/recorded/).
set -uo pipefail
cd "$(dirname "$0")/.."
allow=() keep_html=0 chapters=""
for arg in "$@"; do
  case $arg in
    --allow-cpu) allow=(--allow-cpu) ;;
    --keep-html) keep_html=1 ;;
    --chapters=*) chapters=${arg#--chapters=} ;;  # a rehearsal of some chapters: a|b|c
    *) echo "gpu_site.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
default_out=build/gpu_site
[[ ${#allow[@]} -gt 0 ]] && default_out=/tmp/gpu_site_rehearsal
OUT=$(mkdir -p "${OUT:-$default_out}" && cd "${OUT:-$default_out}" && pwd)
CORES=$(nproc)
started=$SECONDS
say() { echo "[$((SECONDS - started))s] $*"; }

# 1. The dependencies: from the carried wheels, beside the machine's torch.
source docs/gpu_env.sh
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
if [[ ${#allow[@]} -eq 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_site.sh: no CUDA GPU here; --allow-cpu rehearses on a CPU" >&2
  exit 2
fi

# 2. The site, every example run, a failing one included (its traceback is on its page).
export PYTHONPATH="$PWD:$PWD/docs${PYTHONPATH:+:$PYTHONPATH}" PYTHONHASHSEED=0 MPLBACKEND=Agg
export HF_HUB_OFFLINE=1 MPGUIDE_CACHE="$PWD/build/cache" MPGUIDE_DOCS_JOBS=$CORES
export MPGUIDE_GALLERY_KEEP_GOING=1 PYTHONUNBUFFERED=1
# Up to nine examples run at once (the largest chapter): each gets a few of the cores for
# torch's CPU threads instead of every one (a page's device line says how many it had).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(((CORES + 3) / 4))}
rm -rf docs/auto_examples build/doctrees build/html build/jupyter_cache
pattern=()
[[ -n $chapters ]] && pattern=(-D "sphinx_gallery_conf.filename_pattern=/($chapters)/plot_")
command="bash docs/gpu_site.sh $*"
say "building the site: $CORES gallery workers"
timeout --kill-after=15 500 "$PY" -m sphinx -b html -W --keep-going -j auto -d build/doctrees "${pattern[@]}" \
  . build/html >"$OUT/build.log" 2>&1
sphinx=$?
say "sphinx exit $sphinx; log: $OUT/build.log"
grep -E "WARNING|ERROR|failed|Error" "$OUT/build.log" | grep -v IPKernelApp | tail -n 15

# 3. What each example printed and drew on this machine, and how long it took.
"$PY" docs/gallery_recordings.py harvest --out "$OUT/gallery" --command "$command" "${allow[@]}"
harvest=$?
"$PY" docs/gallery_recordings.py times "$OUT"/gallery/*.json | tee "$OUT/times.txt"
[[ $keep_html -eq 1 ]] && tar -czf "$OUT/html.tar.gz" -C build html
du -sh "$OUT/gallery"
say "done: sphinx exit $sphinx, harvest exit $harvest"
[[ $sphinx -eq 0 && $harvest -eq 0 ]]
