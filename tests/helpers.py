"""What several test modules share: the repository's root, and ``python -m mpguide`` run as a
reader would run it, in a process of its own."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mpguide_process(*args: str, cwd=None) -> subprocess.CompletedProcess:
    """Run ``python -m mpguide ARGS`` as a reader would, from ``cwd``, and capture its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mpguide", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env=env,
    )
