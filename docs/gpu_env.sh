# Sourced by docs/gpu_site.sh and docs/gpu_run.sh on a lent GPU machine (no network): sets PY
# to a Python that has the docs and test dependencies, installing them from the carried wheels
# (.whl/, made here by `bash docs/gpu_wheels.sh`) into a virtual environment that sees the
# machine's own packages (its torch with CUDA) where they are missing; about 30 s.
PY=${PYTHON:-python3}
if ! "$PY" -c "import sphinx_gallery, myst_nb, sphinx_design, msgspec, expecttest" 2>/dev/null; then
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "no .whl/: run docs/gpu_wheels.sh where there is a network, and carry .whl" >&2
    exit 2
  fi
  venv=/tmp/mpguide-gpu-venv
  [[ -x $venv/bin/python ]] || "$PY" -m venv --system-site-packages "$venv" || exit 2
  "$venv/bin/python" -m pip install -q --no-index --find-links .whl --no-compile \
    -r .whl/requirements.txt || { echo "installing from .whl/ failed" >&2; exit 2; }
  PY=$venv/bin/python
  echo "installed the wheels of .whl/ into $venv"
fi
