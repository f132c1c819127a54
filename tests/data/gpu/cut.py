"""Cut a real chrome trace down to a window of whole events, as the traces beside this file
were cut (``PROVENANCE.md`` gives each one's command).

``python tests/data/gpu/cut.py SOURCE OUT [--step NAME | --window T0 T1] [--drop KEY ...]``

Kept: every metadata (``ph: "M"``) event; every other CPU-side event that lies wholly inside
the window (an ``X`` event from its start to its end, an instant or flow event at its time);
the GPU events launched by a kept launch (same ``correlation``), with their ``ac2g`` flow
events, and the GPU-side ranges of kept CPU ranges (same ``External id``). Nothing is edited:
each kept event is written as it was read. ``--drop`` leaves out top-level keys of the file
(such as a recording harness's ``metadata``).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

GPU = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}


def _args(event: dict) -> dict:
    args = event.get("args")
    return args if isinstance(args, dict) else {}


def cut(doc: dict, t0: float, t1: float) -> list[dict]:
    events = doc["traceEvents"]

    def inside(e: dict) -> bool:
        return t0 <= e["ts"] and e["ts"] + e.get("dur", 0) <= t1

    cpu = [
        e
        for e in events
        if e.get("ph") != "M" and e.get("cat") not in GPU and e.get("cat") != "ac2g"
    ]
    kept = {id(e) for e in cpu if "ts" in e and inside(e)}
    launched = {_args(e).get("correlation") for e in cpu if id(e) in kept} - {None}
    ranges = {_args(e).get("External id") for e in cpu if id(e) in kept} - {None}
    out = []
    for e in events:
        cat = e.get("cat")
        if e.get("ph") == "M" or id(e) in kept:
            out.append(e)
        elif cat == "gpu_user_annotation":
            if _args(e).get("External id") in ranges:
                out.append(e)
        elif cat in GPU or cat == "ac2g":
            key = e.get("id") if cat == "ac2g" else _args(e).get("correlation")
            if key in launched:
                out.append(e)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path)
    p.add_argument("out", type=Path)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", help="the window of the CPU range with this name")
    which.add_argument("--window", nargs=2, type=float, metavar=("T0", "T1"), help="in us")
    p.add_argument("--drop", nargs="*", default=[], help="top-level keys left out")
    args = p.parse_args()
    with gzip.open(args.source, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    if args.step:
        (step,) = [e for e in events if e.get("name") == args.step and e.get("cat") not in GPU]
        t0, t1 = step["ts"], step["ts"] + step["dur"]
    elif args.window:
        t0, t1 = args.window
    else:
        t0, t1 = float("-inf"), float("inf")
    doc = {k: v for k, v in doc.items() if k not in args.drop}
    doc["traceEvents"] = cut(doc, t0, t1) if (args.step or args.window) else events
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        f.write(json.dumps(doc, separators=(",", ":")).encode())
    print(f"{args.out}: {len(doc['traceEvents'])} of {len(events)} events")


if __name__ == "__main__":
    main()
