"""Check mpguide's GPU kernel times against HolisticTraceAnalysis's kernel breakdown.

Run by ``nox -s bench`` (or ``python benchmarks/hta_kernels.py`` with the PyPI package
``HolisticTraceAnalysis`` installed). For each real GPU trace in tests/data/gpu it reads the
GPU events (kernels, memcpys, memsets) two ways and compares them kernel name by kernel name:

- mpguide: :func:`mpguide.traces.trace.load`, the call tree's GPU events (``Tree.gpu_work``) and
  their ``dur``;
- HTA: ``TraceAnalysis(...).get_gpu_kernel_breakdown(duration_ratio=1,
  include_memory_kernels=True)`` on the same file, every kernel kept (no "others" group) and
  the last profiler step included; the count of a name is its sum over its mean (so only
  without rounding, where no duration is 0 or less).

HTA rounds a trace with sub-microsecond times when it parses it: each event's start up and its
end down to whole microseconds (its log cites pytorch/pytorch#122425). So the breakdown is
taken twice: with that rounding switched off (``HTA_DISABLE_NS_ROUNDING=1``), against
mpguide's durations as they are, and as HTA does by default, against mpguide's durations
rounded the same way. For each name they disagree on, the categories of its events say
why. Each tool is also timed, interleaved ``--repeat`` times in this process,
from reading the file to the per-name sums (HTA with its default rounding). The results and
their provenance go to docs/benchmarks/hta_kernels.json, which docs/benchmarks.md renders.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRACES = ROOT / "tests" / "data" / "gpu"
OUT = ROOT / "docs" / "benchmarks" / "hta_kernels.json"
ROUNDING = "HTA_DISABLE_NS_ROUNDING"

Sums = dict[str, tuple[int, float]]


def by_mpguide(path: Path, rounded: bool = False) -> Sums:
    """Each GPU event name's count and summed duration as mpguide reads them; ``rounded``:
    each event from its start rounded up to its end rounded down, as HTA does."""
    import numpy as np

    from mpguide.traces import trace

    tree = trace.load(path).tree()
    ids = np.flatnonzero(tree.gpu_work)
    ts, dur = tree.trace.ts[ids], tree.dur_us[ids]
    if rounded:
        dur = np.floor(ts + dur) - np.ceil(ts)
    found: dict[str, list[float]] = defaultdict(list)
    names = tree.trace.name
    for name, d in zip(names.codes[ids].tolist(), dur.tolist(), strict=True):
        found[names.values[name]].append(d)
    return {name: (len(ds), sum(ds)) for name, ds in found.items()}


@contextmanager
def hta_rounding(on: bool) -> Iterator[None]:
    before = os.environ.get(ROUNDING)
    os.environ[ROUNDING] = "0" if on else "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ROUNDING]
        else:
            os.environ[ROUNDING] = before


def by_hta(path: Path, rounded: bool = True) -> Sums:
    """Each kernel name's count and summed time in HTA's kernel breakdown."""
    from hta.trace_analysis import TraceAnalysis

    with hta_rounding(rounded):
        analysis = TraceAnalysis(
            trace_files={0: path.name},
            trace_dir=str(path.parent),
            include_last_profiler_step=True,
        )
    _, kernels = analysis.get_gpu_kernel_breakdown(
        visualize=False, duration_ratio=1.0, num_kernels=10**9, include_memory_kernels=True
    )
    columns = (kernels[c].tolist() for c in ("name", "sum (us)", "mean (us)"))
    return {
        str(name): (round(total / mean) if mean else 0, float(total))
        for name, total, mean in zip(*columns, strict=True)
    }


def agreement(mine: Sums, theirs: Sums, counts: bool) -> dict:
    """How far two per-name tallies are apart (and their counts, with ``counts``)."""
    both = set(mine) & set(theirs)
    differ = sorted(n for n in both if counts and mine[n][0] != theirs[n][0])
    diff = {n: abs(mine[n][1] - theirs[n][1]) for n in both}
    return {
        "names": {"mpguide": len(mine), "HTA": len(theirs), "both": len(both)},
        "only mpguide": sorted(set(mine) - set(theirs)),
        "only HTA": sorted(set(theirs) - set(mine)),
        "count differs": differ,
        "total us": {
            "mpguide": sum(t for _, t in mine.values()),
            "HTA": sum(t for _, t in theirs.values()),
        },
        "max abs diff us": max(diff.values(), default=0.0),
        "over 0.001 us": sorted(n for n, d in diff.items() if d > 1e-3),
    }


def categories(path: Path, names: set[str]) -> dict[str, list[str]]:
    """The categories of the events with each of ``names`` in the trace."""
    import numpy as np

    from mpguide.traces import trace

    t = trace.load(path)
    found: dict[str, set[str]] = defaultdict(set)
    for i in np.flatnonzero(np.isin(t.name.codes, [t.name.values.index(n) for n in names])):
        found[t.name.value(i)].add(t.cat.value(i))
    return {n: sorted(found[n]) for n in sorted(names)}


def compare(path: Path) -> dict:
    """Both tools' per-name tallies, exact and with HTA's rounding, and the categories of the
    events of each name they disagree on."""
    exact = agreement(by_mpguide(path), by_hta(path, rounded=False), counts=True)
    rounded = agreement(by_mpguide(path, rounded=True), by_hta(path), counts=False)
    apart = {
        n
        for a in (exact, rounded)
        for key in ("only mpguide", "only HTA", "count differs", "over 0.001 us")
        for n in a[key]
    }
    return {
        "trace": path.name,
        "exact": exact,
        "HTA rounding": rounded,
        "categories apart": categories(path, apart),
    }


def timed(fn, path: Path) -> float:
    start = time.perf_counter()
    fn(path)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5, help="timed runs of each tool per trace")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    logging.disable(logging.WARNING)  # HTA logs every parse, and warns of one step
    from importlib.metadata import version

    import numpy
    import pandas

    load_at_start = os.getloadavg()[0]
    results = []
    for path in sorted(TRACES.glob("*.json.gz")):
        row = compare(path)
        walls: dict[str, list[float]] = {"mpguide": [], "HTA": []}
        for k in range(args.repeat):  # interleaved, in alternating order
            order = [("mpguide", by_mpguide), ("HTA", by_hta)][:: 1 if k % 2 == 0 else -1]
            for name, fn in order:
                walls[name].append(timed(fn, path))
        ratios = [a / b for a, b in zip(walls["mpguide"], walls["HTA"], strict=True)]
        row["wall s"] = {name: statistics.median(w) for name, w in walls.items()}
        row["mpguide / HTA wall"] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
        results.append(row)
        print(json.dumps(row))
    record = {
        "provenance": {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(),
            "HolisticTraceAnalysis": version("HolisticTraceAnalysis"),
            "pandas": pandas.__version__,
            "numpy": numpy.__version__,
            "date": datetime.date.today().isoformat(),
            "command": shlex.join(["python", "benchmarks/hta_kernels.py", *sys.argv[1:]]),
            "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg()[0],
            "repeat": args.repeat,
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
