"""torchao's import-time lines kept off the CLI's stderr and the pages' output."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from mpguide.core import quiet

NOISE = ("Failed to load", "register_constant")


def test_library_imports_drops_only_the_import_lines_and_only_inside(caplog):
    ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    with quiet.library_imports():
        ao.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        pytree.warning("%s is an Enum subclass ... register_constant() ...", "<enum 'K'>")
        ao.warning("Failed to quantize")
    ao.warning("Failed to load /x/torchao/_C.so: after the block")
    assert [r.getMessage() for r in caplog.records] == [
        "Failed to quantize",
        "Failed to load /x/torchao/_C.so: after the block",
    ]


def _run(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'docs'}", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, *(("-c", code) if code else ()), *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


QWEN = """
import torch
import transformers

config = transformers.Qwen2Config(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2,
)


def make():
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    return model, {"input_ids": torch.randint(0, 64, (2, 16)), "use_cache": False}
"""


@pytest.fixture
def with_torchao(tmp_path):
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    (tmp_path / "qwen.py").write_text(QWEN)
    return tmp_path


@pytest.mark.slow  # a fresh interpreter or a pool of processes
def test_the_cli_importing_a_transformers_model_keeps_torchao_off_stderr(with_torchao):
    run = _run("", with_torchao, "-m", "mpguide", "model", "qwen.py:make", "--format", "json")
    assert run.returncode == 0, run.stderr
    assert not [line for line in run.stderr.splitlines() if any(n in line for n in NOISE)]


PAGE = """
import io, sys
import sphinx_helpers
sphinx_helpers.reset_torch_state({}, "plot_x.py", "before")
sys.stdout = sys.stderr = page = io.StringIO()  # as sphinx-gallery captures a page's output
import qwen
qwen.make()
sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
sphinx_helpers.reset_torch_state({}, "plot_x.py", "after")
print(repr(page.getvalue()))
"""


@pytest.mark.slow  # a fresh interpreter or a pool of processes
def test_a_page_building_a_transformers_model_shows_no_torchao_lines(with_torchao):
    run = _run(PAGE, with_torchao)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "''\n"
    assert not [line for line in run.stderr.splitlines() if any(n in line for n in NOISE)]
