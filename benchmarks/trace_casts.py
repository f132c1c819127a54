"""Benchmark ``python -m mpguide casts`` and ``tree`` on large synthetic traces against the
parse limit.

Run by ``nox -s bench`` (or ``python benchmarks/trace_casts.py``). For each size and layer
set it generates a trace under build/bench (kept for later runs), then runs, interleaved and
``--repeat`` times each, as whole processes: ``python -m mpguide casts TRACE --by cause``
(load, tree, cast report, the summary by cause: the goal's command), the same with
``--by cast`` (one row per cast), ``python -m mpguide tree TRACE`` (its default node limit)
and the parse limit: a process that reads the file and decodes it with msgspec into typed
events, and does nothing else. Each round runs them in a rotated order, so a machine that
speeds up or slows down during the run weighs on all of them alike; the ratios to the parse
limit are taken round by round. The package's bytecode is compiled first, as an install
compiles it (a machine with ``PYTHONDONTWRITEBYTECODE`` would otherwise compile every
module again in every run: 0.1 s of each).

Wall time comes from the parent's clock. Peak memory is summed over every process of a run:
each child runs under a small wrapper that reports its own peak resident set size and its
children's (the decode worker), so the sum is the peak of each process added, an upper
bound on what they held at once. The results and their provenance go to
docs/benchmarks/trace_casts.json, which docs/benchmarks.md renders.
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import gzip
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"none": {}, "python+gpu": {"python": True, "gpu": True, "threads": 2}}
GOAL_EVENTS, GOAL_WALL, GOAL_PEAK = 1_000_000, 1.5, 0.75
"""The goal: on 1M cpu_op events without layers, the casts summary (``casts``) within these
ratios to the parse limit."""
TOOLS = ("casts", "casts table", "tree")

# Runs the command in its argv (``-m MODULE ARGS`` or ``-c CODE ARGS``) in this process,
# then writes this process's peak RSS and its children's, in KiB, to the file $PEAK_FILE.
_WRAPPER = """
import os, resource, runpy, sys
kind, what, *rest = sys.argv[1:]
sys.argv = [what, *rest]
try:
    if kind == "-m":
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    else:
        exec(compile(what, "<command>", "exec"), {"__name__": "__main__"})
except SystemExit as end:
    if end.code:
        raise
finally:
    peaks = [resource.getrusage(r).ru_maxrss for r in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    with open(os.environ["PEAK_FILE"], "w") as f:
        f.write(" ".join(map(str, peaks)))
"""

# The parse limit: read the file (decompressing a .gz) and decode it into typed events.
_PARSE_LIMIT = """
import gzip, sys
import msgspec

class Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    args: msgspec.Raw = msgspec.Raw(b"{}")

class Document(msgspec.Struct, gc=False):
    traceEvents: list[Event]

path = sys.argv[1]
with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
    data = f.read()
msgspec.json.decode(data, type=Document)
"""

# The plain parse: the same, with only the fields the tools read of every event (args, the
# bulk of a profiler's export, are skipped by the decoder, not kept as raw bytes).
_PLAIN_PARSE = _PARSE_LIMIT.replace('    args: msgspec.Raw = msgspec.Raw(b"{}")\n', "")


# Where casts spends its time: the same steps as ``python -m mpguide casts``, timed one by
# one in one process (the decode worker included, as in the command), with the decoder and
# the column building timed inside the load of this process's part. Prints JSON.
_PHASES = """
import json, resource, sys, time
clock = {"wall": time.perf_counter, "cpu": time.process_time}
marks = []
def mark(name):
    marks.append((name, {k: f() for k, f in clock.items()},
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
mark("start")
import numpy, msgspec
from mpguide.traces import casts, trace
mark("import")
inside = {"decode": 0.0, "columns": 0.0}
class Timed:
    def __init__(self, decoder):
        self.decoder = decoder
    def decode(self, *args):
        start = time.process_time()
        try:
            return self.decoder.decode(*args)
        finally:
            inside["decode"] += time.process_time() - start
trace._DECODER = Timed(trace._DECODER)
columns = trace._columns
def timed_columns(*args):
    start = time.process_time()
    try:
        return columns(*args)
    finally:
        inside["columns"] += time.process_time() - start
trace._columns = timed_columns
loaded = trace.load(sys.argv[1], args_of=casts.needs_args)
mark("load")
tree = loaded.tree()
mark("tree")
report = casts.report(tree)
mark("report")
report.summary("cause").render("table")
mark("output")
rows = []
for (_, a, _), (name, b, peak) in zip(marks, marks[1:]):
    rows.append({"phase": name, "wall_s": b["wall"] - a["wall"], "cpu_s": b["cpu"] - a["cpu"],
                 "peak_mb": peak})
child = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"phases": rows, "in_load_cpu_s": inside,
                  "worker": {"cpu_s": child.ru_utime + child.ru_stime,
                             "peak_mb": child.ru_maxrss / 1024}}))
"""


def profile(path: Path) -> dict:
    """Per phase of casts (import, load, tree, report, output): wall and CPU seconds of the
    main process and its peak RSS after the phase; the CPU seconds of decoding and of
    building columns inside this process's part of the load; the worker's CPU and peak."""
    out = subprocess.run(
        [sys.executable, "-c", _PHASES, str(path)],
        check=True,
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return json.loads(out.stdout)


COMMANDS = {
    "casts": ["-m", "mpguide", "casts", "TRACE", "--by", "cause"],
    "casts table": ["-m", "mpguide", "casts", "TRACE", "--by", "cast"],
    "tree": ["-m", "mpguide", "tree", "TRACE"],
    "parse limit": ["-c", "PARSE_LIMIT", "TRACE"],
    "plain parse": ["-c", "PLAIN_PARSE", "TRACE"],
}
"""What each measured process runs, ``python`` left out; each tool against the last."""


REFERENCES = {"PARSE_LIMIT": "<the parse limit>", "PLAIN_PARSE": "<the plain parse>"}


def commands(path: Path) -> dict[str, list[str]]:
    given = {"TRACE": str(path), "PARSE_LIMIT": _PARSE_LIMIT, "PLAIN_PARSE": _PLAIN_PARSE}
    return {
        name: [sys.executable, "-c", _WRAPPER, *(given.get(a, a) for a in argv)]
        for name, argv in COMMANDS.items()
    }


def run(argv: list[str]) -> dict[str, float]:
    """Wall seconds, CPU seconds (user + system of the process and its children) and peak
    RSS in MB of one child process (its own, its children's and their sum), its output
    discarded: the benchmark times the work, not the terminal."""
    with tempfile.TemporaryDirectory() as folder:
        peak_file = Path(folder) / "peak"
        start = time.perf_counter()
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PEAK_FILE": str(peak_file)},
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        err = proc.stderr.read().decode() if proc.stderr else ""
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{' '.join(argv[3:])} failed: {err.strip()}")
        own, children = (int(k) / 1024 for k in peak_file.read_text().split())
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall_s": wall, "cpu_s": cpu, "peak_mb": own + children, "main_peak_mb": own}


def trace_file(events: int, layers: str, compressed: bool, folder: Path) -> Path:
    """The synthetic trace, generated in a child so that this process stays small."""
    plain = folder / f"trace_{events}_{layers.replace('+', '_')}.json"
    if not plain.exists():
        print(f"generating {plain.name} ...", flush=True)
        tmp = plain.with_suffix(".tmp")
        code = (
            "import sys; from mpguide.traces import tracegen; "
            f"tracegen.write(sys.argv[1], {events}, **{LAYERS[layers]!r})"
        )
        subprocess.run(
            [sys.executable, "-c", code, str(tmp)],
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        tmp.rename(plain)
    if not compressed:
        return plain
    packed = plain.with_suffix(".json.gz")
    if not packed.exists():
        print(f"compressing {plain.name} ...", flush=True)
        tmp = packed.with_suffix(".tmp")
        with plain.open("rb") as src, gzip.open(tmp, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        tmp.rename(packed)
    return packed


def spread(values: list[float]) -> dict[str, float | list[float]]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": [round(v, 3) for v in values],
    }


def measure(path: Path, repeat: int) -> dict:
    """Every command ``repeat`` times, interleaved in rotated order; per command the spread
    of each figure, per tool the round-by-round ratios to the parse limit, and the load
    average (one minute) at the start of each round: other work on the machine."""
    argv = commands(path)
    names = list(argv)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    load = []
    for r in range(repeat):
        load.append(os.getloadavg()[0])
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(run(argv[name]))
    out = {
        name: {key: spread([x[key] for x in got]) for key in got[0]} for name, got in runs.items()
    }
    out["load_average"] = spread(load)
    for reference, key_name in (("parse limit", "ratio"), ("plain parse", "ratio_plain")):
        for name in TOOLS:
            out[name][key_name] = {
                key: spread(
                    [a[key] / b[key] for a, b in zip(runs[name], runs[reference], strict=True)]
                )
                for key in ("wall_s", "peak_mb")
            }
    return out


def growth(rows: list[dict]) -> dict:
    """Per command, the summed peak's least-squares line over the file's size: MB per GB of
    JSON, the intercept, and what it gives for 10 GB; over the plain traces without layers."""
    plain = [r for r in rows if r["layers"] == "none" and not r["compressed"]]
    if len(plain) < 2:
        return {}
    gb = np.array([r["json_mb"] / 1000 for r in plain])
    out = {}
    for name in (*TOOLS, "parse limit"):
        peak = np.array([r[name]["peak_mb"]["max"] for r in plain])
        slope, intercept = np.polyfit(gb, peak, 1)
        out[name] = {
            "mb_per_gb": float(slope),
            "intercept_mb": float(intercept),
            "at_10_gb_mb": float(intercept + 10 * slope),
        }
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv: list[str], note: str) -> dict:
    from importlib.metadata import version

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {memory:.0f} GiB",
        "python": platform.python_version(),
        "torch": version("torch"),
        "msgspec": version("msgspec"),
        "numpy": version("numpy"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/trace_casts.py", *argv]),
        "commands": {
            name: " ".join(["python", *(REFERENCES.get(a, a) for a in c)])
            for name, c in COMMANDS.items()
        },
        "load_average_at_start": os.getloadavg()[0],
        "note": note,
    }


def line(row: dict) -> str:
    p = row["parse limit"]
    kind = f"{row['layers']}{', gzip' if row['compressed'] else ''}"
    tools = []
    for name in TOOLS:
        wall, peak = (row[name]["ratio"][k] for k in ("wall_s", "peak_mb"))
        tools.append(
            f"{name} {wall['median']:.2f}x [{wall['min']:.2f}-{wall['max']:.2f}] "
            f"{peak['median']:.2f}x peak"
        )
    return (
        f"{row['cpu_op_events']:>9,} cpu_ops  {kind:<10}  {row['json_mb']:5.0f} MB JSON  "
        f"limit {p['wall_s']['median']:5.2f} s {p['peak_mb']['max']:5.0f} MB  " + "  ".join(tools)
    )


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--events",
        type=int,
        nargs="+",
        default=[200_000, 1_000_000, 2_000_000],
        help="cpu_op events per trace (default: %(default)s)",
    )
    p.add_argument(
        "--layers",
        nargs="+",
        default=list(LAYERS),
        choices=list(LAYERS),
        help="layer sets per size (default: all)",
    )
    p.add_argument(
        "--gzip-events",
        type=int,
        nargs="*",
        default=[GOAL_EVENTS],
        help="sizes also measured as .json.gz, without layers (default: %(default)s)",
    )
    p.add_argument("--repeat", type=int, default=3, help="runs of each command per trace")
    p.add_argument(
        "--note",
        default="",
        help="what else the machine was doing, recorded with the results (default: nothing)",
    )
    p.add_argument("--folder", type=Path, default=ROOT / "build" / "bench", help="the traces")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "benchmarks" / "trace_casts.json",
        help="the results file",
    )
    args = p.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    compileall.compile_dir(ROOT / "mpguide", quiet=1)
    cases = [(e, layers, False) for e in args.events for layers in args.layers]
    cases += [(e, "none", True) for e in args.gzip_events]
    paths = {case: trace_file(*case, args.folder) for case in cases}
    record = {"provenance": provenance(argv, args.note), "results": []}
    for case, path in paths.items():
        events, layers, compressed = case
        json_path = args.folder / f"trace_{events}_{layers.replace('+', '_')}.json"
        row = {
            "cpu_op_events": events,
            "layers": layers,
            "compressed": compressed,
            "json_mb": json_path.stat().st_size / 1e6,
            "file_mb": path.stat().st_size / 1e6,
            **measure(path, args.repeat),
        }
        if case == (GOAL_EVENTS, "none", False):
            row["profile"] = profile(path)
        record["results"].append(row)
        print(line(row), flush=True)
    record["provenance"]["load_average_at_end"] = os.getloadavg()[0]
    record["growth"] = growth(record["results"])
    for name, g in record["growth"].items():
        print(
            f"{name}: {g['mb_per_gb']:.0f} MB per GB of JSON, "
            f"{g['at_10_gb_mb'] / 1000:.1f} GB at 10 GB by the line"
        )
    for r in record["results"]:
        if (r["cpu_op_events"], r["layers"], r["compressed"]) == (GOAL_EVENTS, "none", False):
            for key, what in (("ratio_plain", "plain parse"), ("ratio", "parse limit")):
                wall, peak = (r["casts"][key][k]["median"] for k in ("wall_s", "peak_mb"))
                met = wall <= GOAL_WALL and peak <= GOAL_PEAK
                print(
                    f"goal (the casts summary within {GOAL_WALL}x the {what}'s wall time and "
                    f"{GOAL_PEAK}x its peak on {GOAL_EVENTS:,} cpu_ops): "
                    f"{'met' if met else 'not met'} ({wall:.2f}x, {peak:.2f}x)"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
