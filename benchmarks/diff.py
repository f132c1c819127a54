"""Benchmark ``mpguide diff`` and ``mpguide model`` beside DebugMode's logging and bare runs.

Run by ``nox -s bench`` (or ``python benchmarks/diff.py``). Two models, built as
``benchmarks/model_report.py`` builds its stack of pre-norm transformer encoder layers: a
launch-bound stand-in (2 layers, width 64, batch 1, sequence 8) and the 12-layer width-768
model (batch 1, sequence 64 by default: a shared CPU runs its float64 passes in seconds). For
each, every round times, in a rotated order:

- ``diff``: :func:`mpguide.models.diff.diff` under bf16 autocast with ``backward=True``;
- ``model``: :func:`mpguide.models.per_module.report`, the same precision, ``backward=True``;
- ``DebugMode``: ``torch.utils._debug_mode.DebugMode`` (modules recorded, output hashes
  logged) around the autocast forward and backward;
- the bare runs: the autocast forward and backward, the float32 forward and backward, the
  float64 forward, and the float64 forward and backward (of a float64 copy).

Ratios, round by round: ``diff`` to its bare runs (autocast forward+backward plus float64
forward+backward; goal: within 2 on the 12-layer model); diff's floor to the same, where the
floor is what any split into local and inherited error runs at the least: the run, the float64
shadow, and each op again in float64 on the run's inputs (a second float64 forward+backward),
before a single norm; ``model`` to its bare runs (autocast
and float32 forward+backward plus float64 forward); DebugMode to the autocast forward+backward;
and ``model``'s own overhead (report minus its bare runs) to DebugMode's (DebugMode minus the
run it logs; goal: at most 1). Where a goal is missed, ``--profile`` (on by default) writes a
cProfile of one run of the tool that missed it beside the results. The results and their
provenance go to docs/benchmarks/diff.json.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_report import forward, forward_backward, model_and_inputs, provenance, spread, timed

from mpguide.core import device, timing
from mpguide.models import diff, per_module

DIFF_GOAL = 2.0
"""``diff`` within this many times its bare runs on the 12-layer model."""
MODEL_GOAL = 1.0
"""``model``'s own overhead at most this many times DebugMode's on the same runs."""
SIZES = {"stand-in": (2, 64, 1, 8), "12-layer": (12, 768, 1, 64)}
"""Layers, width, batch and sequence of each model."""


def debug_mode_run(model, x, dev, low) -> None:
    from torch.utils._debug_mode import DebugMode

    with DebugMode(record_nn_module=True), DebugMode.log_tensor_hashes():
        forward_backward(model, x, dev, low)


def float64_forward_backward(model, x) -> None:
    out = model(x)
    out.backward(torch.ones_like(out))
    model.zero_grad(set_to_none=True)


def bench_one(name, size, dev, low, repeat, sync) -> dict:
    layers, width, batch, seq = size
    model, x = model_and_inputs(layers, width, batch, seq, dev)
    reference = copy.deepcopy(model).double()
    x64 = x.double()
    tasks = {
        "diff": lambda: diff.diff(model, x, autocast=low, device=dev, backward=True),
        "model": lambda: per_module.report(model, x, autocast=low, device=dev, backward=True),
        "autocast forward+backward": lambda: forward_backward(model, x, dev, low),
        "fp32 forward+backward": lambda: forward_backward(model, x, dev, None),
        "fp64 forward": lambda: forward(reference, x64),
        "fp64 forward+backward": lambda: float64_forward_backward(reference, x64),
    }
    if hasattr(torch.utils, "_debug_mode"):
        tasks["DebugMode"] = lambda: debug_mode_run(model, x, dev, low)
    for task in tasks.values():  # warm-up: first-call costs out of the rounds
        task()
    times: dict[str, list[float]] = {t: [] for t in tasks}
    names = list(tasks)
    for r in range(repeat):
        for t in names[r % len(names) :] + names[: r % len(names)]:
            times[t].append(timed(tasks[t], sync))
        print(
            f"{name}, round {r + 1}: " + ", ".join(f"{t} {times[t][-1]:.3f} s" for t in names),
            flush=True,
        )

    def each(fn):
        return spread([fn(i) for i in range(repeat)])

    def at(t, i):
        return times[t][i]

    def diff_bare(i):
        return at("autocast forward+backward", i) + at("fp64 forward+backward", i)

    def model_bare(i):
        return (
            at("autocast forward+backward", i)
            + at("fp32 forward+backward", i)
            + at("fp64 forward", i)
        )

    ratios = {
        "diff / its bare runs": each(lambda i: at("diff", i) / diff_bare(i)),
        "diff's floor / its bare runs": each(
            lambda i: (diff_bare(i) + at("fp64 forward+backward", i)) / diff_bare(i)
        ),
        "model / its bare runs": each(lambda i: at("model", i) / model_bare(i)),
    }
    if "DebugMode" in times:
        ratios["DebugMode / autocast forward+backward"] = each(
            lambda i: at("DebugMode", i) / at("autocast forward+backward", i)
        )
        ratios["model overhead / DebugMode overhead"] = each(
            lambda i: (
                (at("model", i) - model_bare(i))
                / (at("DebugMode", i) - at("autocast forward+backward", i))
            )
        )
        ratios["diff overhead / DebugMode overhead"] = each(
            lambda i: (
                (at("diff", i) - diff_bare(i))
                / (at("DebugMode", i) - at("autocast forward+backward", i))
            )
        )
    return {
        "model": {
            "layers": layers,
            "width": width,
            "batch": batch,
            "seq": seq,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "seconds": {t: spread(ts) for t, ts in times.items()},
        "ratio": ratios,
        "tasks": tasks,
    }


def missed(name: str, result: dict) -> list[str]:
    """The tools of ``result`` that miss their goal (by their median)."""
    out = []
    ratio = result["ratio"]
    if name == "12-layer" and ratio["diff / its bare runs"]["median"] > DIFF_GOAL:
        out.append("diff")
    over = ratio.get("model overhead / DebugMode overhead")
    if over is not None and over["median"] > MODEL_GOAL:
        out.append("model")
    return out


def profile(task, sync, path: Path) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(lambda: (task(), sync()))
    with path.open("w") as f:
        pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(30)
    print(f"profile written to {path}")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="a device this machine has (default cpu)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument(
        "--seq",
        type=int,
        default=SIZES["12-layer"][3],
        help="the 12-layer model's sequence length (default %(default)s)",
    )
    p.add_argument("--only", choices=sorted(SIZES), help="one of the two models")
    p.add_argument("--no-profile", action="store_true", help="no profile where a goal is missed")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "benchmarks" / "diff.json",
        help="where the results go (default: %(default)s)",
    )
    args = p.parse_args(argv)
    dev = device.resolve(args.device)
    low = torch.bfloat16
    sync = timing.synchronizer(dev)
    sizes = dict(SIZES)
    sizes["12-layer"] = (*sizes["12-layer"][:3], args.seq)
    record = {
        "provenance": provenance(argv, dev),
        "goals": {
            "diff / its bare runs, 12-layer": DIFF_GOAL,
            "model overhead / DebugMode overhead": MODEL_GOAL,
        },
        "results": {},
    }
    record["provenance"]["command"] = record["provenance"]["command"].replace(
        "model_report.py", "diff.py"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        if args.only and name != args.only:
            continue
        result = bench_one(name, size, dev, low, args.repeat, sync)
        tasks = result.pop("tasks")
        result["missed"] = missed(name, result)
        record["results"][name] = result
        for ratio, s in result["ratio"].items():
            print(f"{name}: {ratio}: {s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]")
        for tool in result["missed"] if not args.no_profile else ():
            path = args.out.with_name(f"diff_profile_{name}_{tool}.txt")
            profile(tasks[tool], sync, path)
            result.setdefault("profiles", {})[tool] = path.name
    record["provenance"]["load_average_at_end"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
