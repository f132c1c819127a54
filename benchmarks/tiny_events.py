"""Measure the memory that ``python -m mpguide casts`` and ``tree`` take per event, on traces
of tiny events (``{"ph":"X","name":"a","ts":N,"dur":1}``, 36 to 44 bytes each with the comma, as
N grows): the figure that
:data:`mpguide.traces.trace.BYTES_PER_EVENT` bounds; then a gzip of 55 million of them, read
to the end under a 4 GiB address-space limit, and refused under a 2 GiB one.

Run ``python benchmarks/tiny_events.py`` (minutes; it writes traces of up to 430 MB to a
temporary folder and deletes them). Each command runs as a whole process; its peak memory is
the peak of the resident set summed over its process tree (the command and its decode
worker), sampled every 20 ms from /proc. Bytes per event are the growth of that peak from
the smaller trace to the larger over the events added, so that what every run holds (the
interpreter, the read buffers) drops out. The results and their provenance go to
docs/benchmarks/tiny_events.json, which docs/cli.md shows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

from trace_casts import provenance

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "tiny_events.json"
COMMANDS = {"casts": ["casts"], "tree": ["tree", "--limit", "10"]}
TINY_EVENT = b'{"ph":"X","name":"a","ts":1,"dur":1},'
"""One event of the 55-million-event gzip, with the comma that follows it."""
LIMIT, BOMB_LIMIT, SMALL_LIMIT = 6 << 30, 4 << 30, 2 << 30
"""The address-space limit (``ulimit -v``) of each run, so that the machine stays usable, the
one the 55 million events complete under, and the one they are refused under."""


def write(path: Path, n: int) -> None:
    with path.open("wb") as f:
        f.write(b"[")
        for start in range(0, n, 100_000):
            k = range(start, min(start + 100_000, n))
            f.write(b"".join(b'{"ph":"X","name":"a","ts":%d,"dur":1},' % (2 * i) for i in k))
        f.write(b'{"ph":"X"}]')


def write_bomb(path: Path, members: int = 1950) -> int:
    """A gzip of ``members`` members of 1 MiB of tiny events: how many events it holds."""
    tiny = TINY_EVENT
    events = tiny * ((1 << 20) // len(tiny))
    member = gzip.compress(events, mtime=0)
    with path.open("wb") as f:
        f.write(gzip.compress(b"[", mtime=0))
        for _ in range(members):
            f.write(member)
        f.write(gzip.compress(b'{"ph":"X"}]', mtime=0))
    return members * ((1 << 20) // len(tiny)) + 1


def tree_rss(root: int) -> int:
    """The resident set of process ``root`` and its descendants, in bytes."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        with suppress(OSError):
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            total += pages * os.sysconf("SC_PAGE_SIZE")
        stack.extend(children.get(pid, []))
    return total


def run(args: list[str], limit: int = LIMIT) -> dict:
    """``python -m mpguide ARGS`` under the address-space limit ``limit``: its status, wall
    time, peak memory and its error line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    proc = subprocess.Popen(  # prlimit execs the command: the same process
        ["prlimit", f"--as={limit}", sys.executable, "-m", "mpguide", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.02)
    err = proc.stderr.read().decode()
    return {
        "status": proc.returncode,
        "wall_s": round(time.monotonic() - start, 2),
        "peak_mib": round(peak / 2**20, 1),
        "error": err.strip(),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1000000,10000000", help="two event counts")
    p.add_argument("--note", default="", help="a note stored with the results")
    args = p.parse_args(argv)
    small, large = map(int, args.sizes.split(","))
    record = {"provenance": provenance(argv, args.note), "results": []}
    record["provenance"]["command"] = "python benchmarks/tiny_events.py " + " ".join(argv)
    record["provenance"]["commands"] = {k: "python -m mpguide " + " ".join(c) + " TRACE"
                                        for k, c in COMMANDS.items()}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for n in (small, large):
            path = Path(folder) / f"tiny_{n}.json"
            write(path, n)
            for name, command in COMMANDS.items():
                got = run([*command, str(path)])
                record["results"].append({"events": n, "command": name, **got})
                print(name, n, got, flush=True)
            path.unlink()
        bomb = Path(folder) / "tiny_55m.json.gz"
        events = write_bomb(bomb)
        record["bomb"] = {"events": events, "gzip_bytes": bomb.stat().st_size, "runs": []}
        for name, command, limit in (
            *((name, command, BOMB_LIMIT) for name, command in COMMANDS.items()),
            ("casts", COMMANDS["casts"], SMALL_LIMIT),
        ):
            got = run([*command, str(bomb)], limit)
            got["error"] = got["error"].replace(f"{folder}/", "")
            record["bomb"]["runs"].append({"command": name, "limit_gib": limit >> 30, **got})
            print("bomb", record["bomb"]["runs"][-1], flush=True)
    for name in COMMANDS:
        rows = {r["events"]: r for r in record["results"] if r["command"] == name}
        grew = (rows[large]["peak_mib"] - rows[small]["peak_mib"]) * 2**20
        record.setdefault("bytes_per_event", {})[name] = round(grew / (large - small), 1)
        done = [r for r in record["bomb"]["runs"] if r["command"] == name and r["status"] == 0]
        if done:  # the 55 million against the smaller trace
            grew = (done[0]["peak_mib"] - rows[small]["peak_mib"]) * 2**20
            per_event = grew / (record["bomb"]["events"] - small)
            record.setdefault("bytes_per_event_55m", {})[name] = round(per_event, 1)
    record["provenance"]["load_average_at_end"] = os.getloadavg()[0]
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(record["bytes_per_event"])


if __name__ == "__main__":
    main(sys.argv[1:])
