"""Benchmark ``python -m mpguide casts`` on large synthetic traces, beside a bare ``json.load``.

Run by ``nox -s bench`` (or ``python benchmarks/trace_casts.py``). For each size and layer
set it generates a trace under build/bench (kept for later runs), then times whole processes:
``python -m mpguide casts TRACE --by cause`` (load, tree, cast report, output) ``--repeat``
times, and a process doing only ``json.load`` of the same file. Wall time comes from the
parent's clock; peak memory and CPU time (user + system, less disturbed by other jobs than
wall time) from the child's resource usage. The results and their
provenance (machine, torch, date, command, load average) go to
docs/benchmarks/trace_casts.json, which docs/benchmarks.md renders.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"none": {}, "python+gpu": {"python": True, "gpu": True, "threads": 2}}
GOAL_S, GOAL_MB, GOAL_EVENTS = 4.0, 1200, 1_000_000


def run(argv: list[str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS in MB and CPU seconds (user + system) of one child process,
    with its output discarded: the benchmark times the work, not the terminal."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed with status {proc.returncode}: {err}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def trace_file(events: int, layers: str, folder: Path) -> Path:
    """The synthetic trace, generated in a child so that this process stays small: a child's
    peak memory as the kernel reports it starts from its parent's at fork."""
    path = folder / f"trace_{events}_{layers.replace('+', '_')}.json"
    if not path.exists():
        print(f"generating {path.name} ...", flush=True)
        tmp = path.with_suffix(".tmp")
        code = (
            "import sys; from mpguide import tracegen; "
            f"tracegen.write(sys.argv[1], {events}, **{LAYERS[layers]!r})"
        )
        run([sys.executable, "-c", code, str(tmp)])
        tmp.rename(path)
    return path


def spread(values: list[float]) -> dict[str, float | list[float]]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": [round(v, 3) for v in values],
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv: list[str]) -> dict:
    from importlib.metadata import version

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {memory:.0f} GiB",
        "python": platform.python_version(),
        "torch": version("torch"),
        "msgspec": version("msgspec"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/trace_casts.py", *argv]),
        "load_average_at_start": os.getloadavg()[0],
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--events",
        type=int,
        nargs="+",
        default=[200_000, 1_000_000],
        help="cpu_op events per trace",
    )
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--repeat", type=int, default=5, help="runs of mpguide per trace")
    p.add_argument("--json-repeat", type=int, default=1, help="runs of json.load per trace")
    p.add_argument("--folder", type=Path, default=ROOT / "build" / "bench")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "trace_casts.json")
    args = p.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(argv), "results": []}
    py = sys.executable
    for events in args.events:
        for layers in args.layers:
            path = trace_file(events, layers, args.folder)
            mp = [
                run([py, "-m", "mpguide", "casts", str(path), "--by", "cause"])
                for _ in range(args.repeat)
            ]
            js = [
                run([py, "-c", "import json, sys; json.load(open(sys.argv[1], 'rb'))", str(path)])
                for _ in range(args.json_repeat)
            ]
            row = {
                "cpu_op_events": events,
                "layers": layers,
                "file_mb": path.stat().st_size / 1e6,
                "mpguide_casts_s": spread([w for w, _, _ in mp]),
                "mpguide_casts_peak_mb": spread([m for _, m, _ in mp]),
                "mpguide_casts_cpu_s": spread([c for _, _, c in mp]),
                "json_load_s": spread([w for w, _, _ in js]),
                "json_load_peak_mb": spread([m for _, m, _ in js]),
                "json_load_cpu_s": spread([c for _, _, c in js]),
            }
            record["results"].append(row)
            print(
                f"{events:>9,} cpu_ops  {layers:<10}  {row['file_mb']:6.0f} MB  "
                f"mpguide casts {row['mpguide_casts_s']['median']:6.2f} s "
                f"[{row['mpguide_casts_s']['min']:.2f}-{row['mpguide_casts_s']['max']:.2f}]  "
                f"{row['mpguide_casts_peak_mb']['max']:6.0f} MB  "
                f"cpu {row['mpguide_casts_cpu_s']['median']:5.2f} s   "
                f"json.load {row['json_load_s']['median']:6.2f} s "
                f"{row['json_load_peak_mb']['max']:6.0f} MB",
                flush=True,
            )
    record["provenance"]["load_average_at_end"] = os.getloadavg()[0]
    goal = [
        r for r in record["results"] if r["cpu_op_events"] == GOAL_EVENTS and r["layers"] == "none"
    ]
    for r in goal:
        ok = (
            r["mpguide_casts_s"]["median"] <= GOAL_S
            and r["mpguide_casts_peak_mb"]["max"] <= GOAL_MB
        )
        print(
            f"goal ({GOAL_S} s, {GOAL_MB} MB on {GOAL_EVENTS:,} cpu_ops): "
            f"{'met' if ok else 'not met'}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
