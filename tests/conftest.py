import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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
