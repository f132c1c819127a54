import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mpguide_process

from mpguide.cli import main

DATA = Path(__file__).parent / "data"
MATMUL = str(DATA / "autocast_matmul.json.gz")


def test_tree_of_an_op_with_fields_and_depth(capsys):
    assert (
        main(["tree", MATMUL, "--op", "aten::matmul", "--fields", "Input type", "--depth", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("└── aten::matmul  Input type: ['c10::BFloat16', 'float']")
    assert "├── aten::to  Input type: ['float'," in out
    assert "_to_copy" not in out and "Input Dims" not in out
    assert out.rstrip().splitlines()[-1].startswith("anomalies: overlaps 0")


def test_tree_by_id(capsys):
    assert main(["tree", MATMUL, "--op", "aten::matmul"]) == 0
    assert main(["tree", MATMUL, "--id", "0", "--fields", ""]) == 0
    assert capsys.readouterr().out.count("ProfilerStep#") == 1


@pytest.mark.parametrize("fmt", ["table", "json", "csv"])
def test_casts_formats(capsys, fmt):
    assert main(["casts", MATMUL, "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "aten::matmul" in out and "bfloat16" in out
    if fmt == "json":
        rows = json.loads(out)["rows"]
        assert {(r["source"], r["target"]) for r in rows} == {
            ("float32", "bfloat16"),
            ("bfloat16", "float32"),
        }


def test_casts_summary(capsys):
    assert main(["casts", MATMUL, "--by", "pair", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("source,target,casts,")


@pytest.mark.parametrize(
    ("argv", "content", "message"),
    [
        (["casts"], None, "no such file"),
        (["tree"], None, "no such file"),
        (["casts"], b'{"traceEvents": [', "not valid JSON"),
        (["tree"], b"<html>", "not valid JSON"),
        (["casts"], b'{"a": 1}', "not a chrome trace"),
        (["tree", "--id", "999"], b'{"traceEvents": []}', "no node with id 999"),
        (["tree", "--op", "aten::nope"], b'{"traceEvents": []}', "no op named 'aten::nope'"),
        (["tree", "--depth", "-1"], b'{"traceEvents": []}', "--depth must be 0 or more"),
        (["casts", "--format", "xml"], b'{"traceEvents": []}', "invalid choice: 'xml'"),
    ],
)
def test_bad_input_gives_one_line_and_status_2(tmp_path, capsys, argv, content, message):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_bytes(content)
    assert main([argv[0], str(path), *argv[1:]]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err


def test_casts_as_a_process_without_torch(tmp_path):
    code = (
        "import sys; from mpguide.cli import main; rc = main(['casts', sys.argv[1]]); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, MATMUL], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "aten::matmul" in proc.stdout
    bad = mpguide_process("casts", str(tmp_path / "x.json"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("mpguide: error: ")
