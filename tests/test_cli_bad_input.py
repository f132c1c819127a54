"""The command line on bad input that names the wrong cause or none: the reader's code
raising a BaseException, a closed stdin, a per-trace view asked of a directory. Each ends
with one line on stderr and exit status 2."""

import io
import json
import sys

import pytest

from mpguide.cli import main


def one_line(capsys, *words: str) -> str:
    """The one line on stderr of a :func:`main` that returned 2, saying ``words``."""
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("mpguide: error: ") and captured.err.count("\n") == 1
    for word in words:
        assert word in captured.err, captured.err
    return captured.err


def write_trace(path, *events) -> str:
    path.write_text(json.dumps({"traceEvents": list(events)}))
    return str(path)


def op(name, ts, dur):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}


_RAISES_BASE = """
import torch

class Mine(BaseException):
    pass

if {at_import}:
    raise GeneratorExit("at import")

class Raises(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        raise Mine("in forward")

def make():
    return Raises(), torch.randn(2, 4)

def fn(x):
    raise Mine("in fn")
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["model", "{f}:make"],
        ["model", "{f}:make", "--target", "mxfp8"],
        ["inference", "--model", "{f}:make", "--repeat", "1", "--warmup", "0"],
        ["graph", "{f}:fn", "--inputs", "f32[4]"],
    ],
)
@pytest.mark.parametrize("at_import", [False, True])
def test_a_base_exception_of_the_readers_code_is_one_line(tmp_path, capsys, argv, at_import):
    path = tmp_path / f"raises_base_{at_import}.py"  # a module name of its own per case
    path.write_text(_RAISES_BASE.format(at_import=at_import))
    assert main([a.format(f=path) for a in argv]) == 2
    if at_import:
        one_line(capsys, f"importing {path} raised GeneratorExit: at import")
    else:
        one_line(capsys, "raised Mine: in f")


def test_a_closed_stdin_is_called_closed(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", None)  # as Python sets it when file descriptor 0 is closed
    assert main(["tree", "-"]) == 2
    one_line(capsys, "no trace on stdin, which is closed")
    closed = io.TextIOWrapper(io.BufferedReader(io.BytesIO(b"[]")))
    closed.close()
    monkeypatch.setattr(sys, "stdin", closed)
    assert main(["casts", "-"]) == 2
    one_line(capsys, "no trace on stdin, which is closed")


@pytest.mark.parametrize("by", ["cast", "fused"])
def test_a_per_trace_view_of_a_directory_is_refused(tmp_path, capsys, by):
    write_trace(tmp_path / "rank0.json", op("a", 1.0, 1.0))
    assert main(["casts", str(tmp_path), "--by", by]) == 2
    one_line(capsys, f"--by {by} shows one trace's casts: give a file")
