"""What ``torch.compile`` writes out: the artifacts ``TORCH_LOGS`` logs, and the roundings
the code inductor generated computes and then drops."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence

from mpguide import MPGuideError

_LOG_LINE = re.compile(r"^[A-Z]\d{4} [\d:.]+ +\d+ \S+\] (?:\[[^\]]*\] )*\[__(\w+)\] ?(.*)$")


def torch_logs(
    script: str, artifacts: Sequence[str], cached: bool = True, timeout: float = 600
) -> dict[str, str]:
    """Run ``script`` in a fresh Python with ``TORCH_LOGS`` set to ``artifacts`` (``graph_code``,
    ``aot_graphs``, ``post_grad_graphs``, ``output_code``, ...) and return what each artifact
    logged, its log prefixes taken off. Nothing in this process's logging changes.

    A compile served from torch.compile's caches skips stages and their logs; ``cached=False``
    turns the caches off for the script so every stage runs and logs."""
    env = {**os.environ, "TORCH_LOGS": ",".join(artifacts)}
    if not cached:
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MPGuideError(f"the script exited with status {proc.returncode}: {last}")
    logged: dict[str, list[str]] = {a: [] for a in artifacts}
    for line in proc.stderr.splitlines():
        m = _LOG_LINE.match(line)
        if m and m[1] in logged:
            logged[m[1]].append(m[2])
    return {a: "\n".join(lines) for a, lines in logged.items()}


_ASSIGNED_CONVERSION = re.compile(r"^\s*(?:auto\s+)?(tmp\d+)\s*=\s*.*(?:convert|\.to\()")


def unused_conversions(kernel: str) -> list[str]:
    """The lines of generated kernel code that convert a value to another dtype into a
    temporary that nothing reads afterwards: a rounding the fused kernel computes and drops."""
    lines = kernel.splitlines()
    unused = []
    for i, line in enumerate(lines):
        m = _ASSIGNED_CONVERSION.match(line)
        if m and not any(re.search(rf"\b{m[1]}\b", later) for later in lines[i + 1 :]):
            unused.append(line.strip())
    return unused
