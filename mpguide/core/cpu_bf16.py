"""Whether bf16 pays on this CPU: its bf16 instruction sets, and the time of each op family in
float32, in bf16 and under CPU autocast, measured here, and measured again in a child process
whose oneDNN and ATen kernels are capped at AVX2 (what a CPU without AVX512-BF16 or AMX runs).

The cap is software: ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2`` make the
libraries dispatch to their AVX2 kernels on the same processor, so it shows the kernels an
older CPU would get, at this machine's clock and memory. ``python -m mpguide.core.cpu_bf16``
prints the measurement as JSON (what the child process runs).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mpguide import MPGuideError
from mpguide.core import timing
from mpguide.core.table import Table

BF16_FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "avx2")
"""The ``/proc/cpuinfo`` flags that decide how fast bf16 runs on an x86 CPU."""
CAPPED = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
"""The environment that caps oneDNN's and ATen's kernels at AVX2."""
MODES = ("float32", "bfloat16", "autocast bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, bool] | None:
    """Which of :data:`BF16_FLAGS` the CPU reports (``None`` where ``cpuinfo`` cannot be read:
    not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    return {flag: flag in have for flag in BF16_FLAGS}


def _inputs(scale: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(64 * scale, 1024, generator=gen),
        "w": torch.randn(1024, 1024, generator=gen),
        "img": torch.randn(2, 32, 16 * scale, 16 * scale, generator=gen),
        "cw": torch.randn(32, 32, 3, 3, generator=gen),
    }


FAMILIES: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "linear (matmul)": lambda t: F.linear(t["x"], t["w"]),
    "conv2d 3x3": lambda t: F.conv2d(t["img"], t["cw"], padding=1),
    "layer_norm": lambda t: F.layer_norm(t["x"], (t["x"].shape[-1],)),
    "softmax": lambda t: torch.softmax(t["x"], -1),
    "gelu": lambda t: F.gelu(t["x"]),
}


def measure(repeat: int = 15, scale: int = 2, threads: int = 1) -> Table:
    """Median and interquartile range (ms) of each op family in each of :data:`MODES`, timed
    in interleaved rounds on ``threads`` threads; ``scale`` sizes the inputs."""
    if repeat < 3 or scale < 1:
        raise MPGuideError(f"need repeat >= 3 and scale >= 1, got {repeat} and {scale}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        f32 = _inputs(scale)
        b16 = {k: v.bfloat16() for k, v in f32.items()}
        fns = {}
        for name, op in FAMILIES.items():
            fns[(name, MODES[0])] = lambda op=op: op(f32)
            fns[(name, MODES[1])] = lambda op=op: op(b16)

            def autocast(op=op):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return op(f32)

            fns[(name, MODES[2])] = autocast
        with torch.no_grad():
            lat = timing.compare_latency(
                {f"{n} | {m}": fn for (n, m), fn in fns.items()}, "cpu", warmup=2, repeat=repeat
            )
    finally:
        torch.set_num_threads(before)
    rows = []
    for name in FAMILIES:
        base = lat[f"{name} | {MODES[0]}"]
        for mode in MODES:
            one = lat[f"{name} | {mode}"]
            rows.append((name, mode, one.median * 1e3, one.spread * 1e3, one.median / base.median))
    return Table(
        ("op family", "mode", "median ms", "IQR ms", "x float32"),
        tuple(rows),
        f"{threads} thread(s), {repeat} interleaved rounds, torch {torch.__version__}, "
        f"kernels {torch.backends.cpu.get_cpu_capability()}",
    )


@dataclass(frozen=True)
class Timings:
    """The same table measured with the CPU's own kernels and with kernels capped at AVX2."""

    native: Table
    capped: Table

    def ratio(self, which: str, family: str, mode: str = "bfloat16") -> float:
        """``mode``'s median over float32's for ``family`` in ``which`` (native or capped)."""
        table = getattr(self, which)
        for r in table.records():
            if r["op family"] == family and r["mode"] == mode:
                return r["x float32"]
        raise MPGuideError(f"no row {family!r}, {mode!r}")

    def table(self) -> Table:
        rows = tuple(
            (
                n["op family"],
                n["mode"],
                n["median ms"],
                n["x float32"],
                c["median ms"],
                c["x float32"],
            )
            for n, c in zip(self.native.records(), self.capped.records(), strict=True)
        )
        return Table(
            ("op family", "mode", "native ms", "native x fp32", "AVX2 cap ms", "AVX2 cap x fp32"),
            rows,
            f"medians; native: {self.native.caption}; capped: {self.capped.caption}",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _table(doc: dict) -> Table:
    return Table(tuple(doc["columns"]), tuple(tuple(r) for r in doc["rows"]), doc["caption"])


def capped(repeat: int = 15, scale: int = 2, timeout: float = 300) -> Table:
    """:func:`measure` in a child process whose kernels are capped at AVX2 (:data:`CAPPED`)."""
    env = {**os.environ, **CAPPED}
    cmd = [sys.executable, "-m", "mpguide.core.cpu_bf16", str(repeat), str(scale)]
    try:
        done = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=True
        )
    except (subprocess.SubprocessError, OSError) as err:
        raise MPGuideError(f"the capped measurement failed: {err}") from None
    return _table(json.loads(done.stdout))


def timings(repeat: int = 15, scale: int = 2) -> Timings:
    """:func:`measure` here and in a child process capped at AVX2."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise MPGuideError(f"the AVX2 cap needs an x86 CPU, not {platform.machine()}")
    return Timings(measure(repeat, scale), capped(repeat, scale))


def _main(argv: Sequence[str]) -> int:
    table = measure(int(argv[0]), int(argv[1]))
    print(json.dumps({"columns": table.columns, "rows": table.rows, "caption": table.caption}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
