"""Benchmark ``mpguide.models.per_module.report`` on a 12-layer transformer of width 768 against the runs
it stands beside.

Run by ``nox -s bench`` (or ``python benchmarks/model_report.py``). The model is a stack of
pre-norm :class:`torch.nn.TransformerEncoderLayer` (width 768, 12 heads, feed-forward 3072,
no dropout) on a batch of 8 sequences of 128, on the CPU unless ``--device`` says otherwise.
Each round times, in a rotated order so that a machine that speeds up or slows down weighs on
all of them alike:

- the report: ``per_module.report(model, x, autocast=DTYPE, backward=True)``;
- the yardstick: one float32 forward and backward (ones as output gradients, as the report
  does) and one float64 forward of a float64 copy, timed apart and added;
- the report's own runs, bare: the forward and backward under autocast, the same with
  autocast off (the report's run for autocast's share of the casts), and the float64
  forward; added, they are what the report costs before its hooks, logs and comparisons.

Ratios are taken round by round: the report to the yardstick (the goal: under 3), the
report to its bare runs (its own overhead, goal 1.3), and that overhead in seconds to the
yardstick. Where the low-precision kernels are slow (a CPU without native bf16 arithmetic) the
first ratio measures them and the second hides the overhead behind them; the third does not
depend on them. The
results and their provenance go to docs/benchmarks/model_report.json, which
docs/benchmarks.md renders.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import json
import os
import platform
import pstats
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpguide.compiled import graphs
from mpguide.core import device, dtypes, timing
from mpguide.models import per_module

GOAL = 3.0
"""The report within this many times the float32 forward and backward plus the float64
forward."""
OWN_GOAL = 1.3
"""The report within this many times its own runs, bare."""


def model_and_inputs(layers: int, width: int, batch: int, seq: int, dev: torch.device):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        width, width // 64, 4 * width, dropout=0.0, batch_first=True, norm_first=True
    )
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(dev).eval()
    return model, torch.randn(batch, seq, width, device=dev)


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def forward_backward(model, x, dev, autocast: torch.dtype | None) -> None:
    with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(x)
    graphs.backward_once(out)


def forward(model, x) -> None:
    with torch.no_grad():
        model(x)


def spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def low_precision_flags() -> list[str]:
    """The CPU's flags for bf16 and fp16 arithmetic (``avx512_bf16``, ``amx_bf16``,
    ``avx512_fp16``, ...), from /proc/cpuinfo; empty where it reports none or cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    return sorted(f for f in set(flags) if "bf16" in f or "fp16" in f or f.startswith("amx"))


def provenance(argv: list[str], dev: torch.device) -> dict:
    return {
        "machine": f"{device.describe(dev).caption()}; {os.cpu_count()} cores",
        "detail": device.describe(dev).detail,
        "cpu_low_precision_flags": low_precision_flags(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/model_report.py", *argv]),
        "load_average_at_start": os.getloadavg()[0],
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12, help="encoder layers (default 12)")
    p.add_argument("--width", type=int, default=768, help="model width (default 768)")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--autocast", default="bfloat16", help="autocast dtype (default bfloat16)")
    p.add_argument("--device", default="cpu", help="a device this machine has (default cpu)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "benchmarks" / "model_report.json",
        help="where the results go (default: %(default)s)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        help="also profile one report after the rounds (cProfile): the stats to this file, "
        "the 40 costliest calls by cumulative time beside it (.txt)",
    )
    args = p.parse_args(argv)
    dev = device.resolve(args.device)
    low = dtypes.autocast_dtype(args.autocast)
    sync = timing.synchronizer(dev)
    model, x = model_and_inputs(args.layers, args.width, args.batch, args.seq, dev)
    reference = copy.deepcopy(model).double()
    x64 = x.double()
    record = {"provenance": provenance(argv, dev)}
    tasks = {
        "report": lambda: per_module.report(model, x, autocast=low, device=dev, backward=True),
        "fp32 forward+backward": lambda: forward_backward(model, x, dev, None),
        "fp64 forward": lambda: forward(reference, x64),
        "autocast forward+backward": lambda: forward_backward(model, x, dev, low),
    }
    times: dict[str, list[float]] = {name: [] for name in tasks}
    names = list(tasks)
    # Warm-up: first-call costs (and the import of torch._dynamo that a dispatch mode's first
    # op makes, once a process) out of the rounds.
    forward_backward(model, x, dev, low)
    small, xs = model_and_inputs(1, 64, 1, 8, dev)
    per_module.report(small, xs, autocast=low, device=dev, backward=True)
    for r in range(args.repeat):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(timed(tasks[name], sync))
            print(f"round {r + 1}: {name} {times[name][-1]:.2f} s", flush=True)
    yardstick = [
        a + b for a, b in zip(times["fp32 forward+backward"], times["fp64 forward"], strict=True)
    ]
    bare = [
        a + b + c
        for a, b, c in zip(
            times["autocast forward+backward"],
            times["fp32 forward+backward"],
            times["fp64 forward"],
            strict=True,
        )
    ]
    record["provenance"]["load_average_at_end"] = os.getloadavg()[0]
    record["model"] = {
        "layers": args.layers,
        "width": args.width,
        "batch": args.batch,
        "seq": args.seq,
        "parameters": sum(p.numel() for p in model.parameters()),
        "autocast": str(low).removeprefix("torch."),
        "device": dev.type,
    }
    record["seconds"] = {name: spread(ts) for name, ts in times.items()}
    record["ratio"] = {
        "report / (fp32 forward+backward + fp64 forward)": spread(
            [a / b for a, b in zip(times["report"], yardstick, strict=True)]
        ),
        "report / its bare runs": spread(
            [a / b for a, b in zip(times["report"], bare, strict=True)]
        ),
        "(report - its bare runs) / (fp32 forward+backward + fp64 forward)": spread(
            [(a - b) / c for a, b, c in zip(times["report"], bare, yardstick, strict=True)]
        ),
        "autocast forward+backward / fp32 forward+backward": spread(
            [
                a / b
                for a, b in zip(
                    times["autocast forward+backward"], times["fp32 forward+backward"], strict=True
                )
            ]
        ),
    }
    record["goal"] = GOAL
    record["own_goal"] = OWN_GOAL
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for name, s in record["ratio"].items():
        print(f"{name}: {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]")
    print(f"written to {args.out}")
    if args.profile:
        profile(tasks["report"], sync, args.profile)


def profile(report, sync, path: Path) -> None:
    """One report under cProfile, the device synchronised before it ends (time a GPU spends
    waiting on the report's own reads of results shows in the calls that read them)."""
    profiler = cProfile.Profile()
    profiler.runcall(lambda: (report(), sync()))
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.dump_stats(path)
    with path.with_suffix(".txt").open("w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(40)
    print(f"profile written to {path} and {path.with_suffix('.txt')}")


if __name__ == "__main__":
    main(sys.argv[1:])
