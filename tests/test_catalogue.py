"""The autocast catalogue's import of torch's OpInfo samples."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT

_FRESH = """
import sys, warnings
sys.modules["hypothesis"] = None  # the docs environment has none: torch's utilities warn
warnings.simplefilter("error")
import torch
from mpguide.autocast import catalogue
assert catalogue.has_samples()
assert not torch.backends.flags_frozen()
torch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32  # raises when frozen
print("ok")
"""


@pytest.mark.slow  # a fresh interpreter or a pool of processes
def test_importing_the_opinfo_samples_leaves_flags_thawed_and_stderr_empty():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", _FRESH],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert (run.stdout, run.stderr) == ("ok\n", "")
