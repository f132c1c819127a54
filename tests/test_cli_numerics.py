import csv
import io
import json

import pytest
import torch

from mpguide.cli import main
from mpguide.precision import formats


def test_formats_json_matches_finfo(capsys):
    assert main(["formats", "--format", "json"]) == 0
    rows = {r["format"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert list(rows) == [f.name for f in formats.formats()]
    assert rows["float16"]["max"] == torch.finfo(torch.float16).max
    assert rows["bfloat16"]["min normal"] == torch.finfo(torch.bfloat16).smallest_normal
    assert (rows["tf32"]["exponent"], rows["tf32"]["mantissa"]) == (8, 10)


def test_formats_csv_has_a_row_per_format(capsys):
    assert main(["formats", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["format"] for r in rows] == [f.name for f in formats.formats()]


@pytest.mark.parametrize("fmt", ["table", "markdown"])
def test_formats_text(capsys, fmt):
    assert main(["formats", "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "tf32" in out and "float8_e4m3fn" in out


def test_unknown_format_is_one_line_with_status_2(capsys):
    assert main(["formats", "--format", "xml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("mpguide: error: ") and "invalid choice: 'xml'" in captured.err


def test_formats_in_markdown(mpguide_main):
    proc = mpguide_main("formats", "--format", "markdown")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("**Floating-point formats in torch")
