import json

import pytest
from helpers import mpguide_process

from mpguide import MPGuideError
from mpguide.cli import main
from mpguide.models import inference

FACTORY = """
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(4, 8)


def not_a_pair():
    return 42


def raises():
    raise ValueError("the reader's bug")


def exits():
    raise SystemExit(3)


def text_inputs():
    return nn.Linear(8, 3), "hello"


def wrong_shape():
    return nn.Linear(8, 3), torch.randn(4, 5)
"""


@pytest.fixture
def factory(tmp_path, monkeypatch):
    (tmp_path / "reader_model.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "reader_model"


def test_json_has_a_row_per_variant(capsys, factory):
    argv = [
        "inference",
        "--model",
        f"{factory}:make",
        "--device",
        "cpu",
        "--variants",
        "fp32,bf16,autocast-bf16",
        "--repeat",
        "2",
        "--warmup",
        "1",
        "--format",
        "json",
    ]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["variant"] for r in rows] == ["fp32", "bf16 weights", "autocast bf16"]
    assert rows[0]["max |err|"] == 0 and rows[0]["logits"] == "float32"
    assert rows[1]["params KiB"] * 2 == rows[0]["params KiB"] == rows[2]["params KiB"]


def test_variant_names():
    assert inference.variant("fp16").weights.is_floating_point
    assert inference.variant("bf16+compile").compile
    with pytest.raises(MPGuideError, match="unknown variant 'int8'"):
        inference.variant("int8")
    with pytest.raises(MPGuideError, match="unknown variant 'bf16\\+jit'"):
        inference.variant("bf16+jit")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inference"], "required: --model"),
        (["inference", "--model", "nocolon"], "give FILE.py:NAME or package.module:NAME"),
        (["inference", "--model", "no_such_module_here:make"], "cannot import"),
        (["inference", "--model", "reader_model:missing"], "has no function 'missing'"),
        (["inference", "--model", "reader_model:not_a_pair"], "must return (model, inputs)"),
        (["inference", "--model", "reader_model:raises"], "raised ValueError: the reader's bug"),
        (["inference", "--model", "reader_model:exits"], "raised SystemExit(3)"),
        (
            ["inference", "--model", "reader_model:text_inputs"],
            "inputs must be a tensor, a tuple or list",
        ),
        (
            ["inference", "--model", "reader_model:wrong_shape", "--device", "cpu"],
            "running the model of reader_model:wrong_shape on its inputs raised RuntimeError",
        ),
        (["inference", "--model", "reader_model:make", "--variants", "fp8"], "unknown variant"),
        (["inference", "--model", "reader_model:make", "--repeat", "0"], "--repeat >= 1"),
        (["inference", "--model", "reader_model:make", "--device", "tpu"], "unknown device"),
    ],
)
def test_bad_arguments_give_one_line_and_status_2(capsys, factory, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("mpguide: error: ") and message in captured.err


@pytest.mark.slow
def test_as_a_process(tmp_path):
    """Run from the reader's folder, where their module lives."""
    (tmp_path / "reader_model.py").write_text(FACTORY)
    proc = mpguide_process(
        "inference",
        "--model",
        "reader_model:make",
        "--device",
        "cpu",
        "--variants",
        "fp32,fp16",
        "--repeat",
        "2",
        "--format",
        "csv",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("variant,same class %,max |err|,mean |err|")
    assert "fp16 weights" in proc.stdout
    assert "profiler_start" not in proc.stderr  # the profiler's own lines stay off stderr


def test_progress_names_each_variant_when_forced(capsys, factory, monkeypatch):
    argv = ["inference", "--model", f"{factory}:make", "--device", "cpu", "--repeat", "1"]
    argv += ["--warmup", "0", "--variants", "fp32,bf16"]
    assert main(argv) == 0
    assert capsys.readouterr().err == ""  # not a terminal: stderr keeps its contract
    monkeypatch.setenv("MPGUIDE_PROGRESS", "1")
    seen = []
    monkeypatch.setattr(
        "mpguide.models.progress.Progress.__call__", lambda self, text: seen.append(text)
    )
    assert main(argv) == 0
    assert seen == [
        "measuring fp32 (1 of 2 variants)",
        "measuring bf16 weights (2 of 2 variants)",
        "timing: call 1 of 2 (fp32)",
        "timing: call 2 of 2 (bf16 weights)",
    ]


def test_at_80_columns_the_latency_is_kept_and_the_error_named(capsys, factory, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["inference", "--model", f"{factory}:make", "--variants", "fp32,bf16", "--repeat", "2"]
    assert main([*argv, "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()  # the header is the line above the rule (the caption may wrap)
    rule = next(i for i, line in enumerate(lines) if line and set(line) <= {"-", " "})
    header = lines[rule - 1].split("  ")
    assert {"same class %", "max |err|", "median ms", "IQR ms"} <= {h.strip() for h in header}
    assert max(map(len, out.splitlines())) <= 80
    assert "|err|: |logit - fp32 model's logit|, absolute" in " ".join(out.split())
