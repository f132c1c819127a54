import json

import pytest
import torch
from conftest import mpguide_process

from mpguide.cli import main


def test_policy_json_matches_the_catalogue(capsys):
    from mpguide import policy

    assert main(["policy", "--device", "cpu", "--dtype", "bf16", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == len(policy.CATALOGUE)
    matmul = next(r for r in data["rows"] if r["op"] == "matmul")
    assert matmul["class"] == "lower precision"


@pytest.mark.parametrize("fmt", ["table", "markdown", "csv"])
def test_policy_formats(capsys, fmt):
    assert main(["policy", "--device", "cpu", "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "matmul" in out and "lower precision" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["policy", "--device", "tpu"], "unknown device 'tpu'"),
        (["policy", "--dtype", "int8"], "unknown dtype 'int8'"),
        (["policy", "--dtype", "float32"], "bfloat16 or float16"),
        (["policy", "--format", "xml"], "invalid choice: 'xml'"),
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_give_one_line_and_status_2(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("mpguide: error: ") and message in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_missing_cuda_as_a_process():
    proc = mpguide_process("policy", "--device", "cuda")
    assert proc.returncode == 2
    assert proc.stderr.startswith("mpguide: error: device 'cuda' is not available")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
