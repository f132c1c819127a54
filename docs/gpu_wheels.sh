#!/usr/bin/env bash
# The wheels a lent GPU machine (Python 3.12, x86-64, torch with CUDA, no network) needs to build
# the site and run the tests: every package of pyproject's `docs` and `test` extras and of the
# core dependencies, with their dependencies, for CPython 3.12 on manylinux, less what that
# machine has already and what it must not replace (torch and its CUDA libraries, numpy,
# matplotlib and theirs: see PRESENT). They land in .whl/ (ignored by git through
# .git/info/exclude) and travel with the call: `run` carries at most 64 MiB, the working tree
# included, so the script stops if the two together do not fit.
# docs/gpu_site.sh and docs/gpu_run.sh install them into a virtual environment that sees the
# machine's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null ||
  echo '/.whl/' >>"$(git rev-parse --git-path info/exclude)"
# On the GPU machine already (its image has torch 2.11+cu130, numpy, matplotlib, pytest,
# pytest-xdist, hypothesis and transformers, with their dependencies): not carried.
PRESENT='^(torch|triton|nvidia_.*|cuda_.*|numpy|matplotlib|pillow|kiwisolver|fonttools|contourpy|cycler|pyparsing|python_dateutil|six|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec|typing_extensions|setuptools|pytest|pytest_xdist|execnet|pluggy|iniconfig|hypothesis|sortedcontainers|attrs|transformers|huggingface_hub|hf_xet|tokenizers|safetensors|regex|tqdm|httpx2?|httpcore2?|h11|anyio|typer|click|rich|shellingham|annotated_doc|truststore)-'
reqs=$(python3 - <<'PY'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = p["optional-dependencies"]
specs = p["dependencies"] + extras["docs"] + extras["test"]
keep = [s for s in dict.fromkeys(specs) if not re.match(r"(torch|numpy|matplotlib)\b", s)]
print("\n".join(keep))
PY
)
rm -rf .whl.part && mkdir -p .whl.part
echo "$reqs" >.whl.part/requirements.txt
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform linux_x86_64 -d .whl.part -r .whl.part/requirements.txt 2>&1 |
  grep -v '^WARNING: Location' || true
for w in .whl.part/*.whl; do
  if [[ $(basename "$w") =~ $PRESENT ]]; then rm "$w"; fi
done
rm -rf .whl && mv .whl.part .whl
wheels=$(du -cb .whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | awk '$2 == "total" {s += $1} END {print s}')
echo "$(ls .whl/*.whl | wc -l) wheels, $((wheels / 1048576)) MiB; with the working tree" \
  "($((tree / 1048576)) MiB): $(((wheels + tree) / 1048576)) MiB of the 64 MiB a call carries"
((wheels + tree < 64 * 1048576)) || { echo "too large to carry" >&2; exit 1; }
