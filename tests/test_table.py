import csv
import io
import json

import pytest
import torch

from mpguide.table import Table, from_records

T = Table(
    ("op", "dtype", "error"),
    (("mm", torch.bfloat16, 0.5), ("sum|x", torch.float32, None)),
    "caption here",
)


def test_text_aligns_columns_and_shows_dtype_names():
    lines = T.to_text().splitlines()
    assert lines[0] == "caption here"
    assert lines[1].split() == ["op", "dtype", "error"]
    assert lines[3].split() == ["mm", "bfloat16", "0.5"]
    assert lines[1].index("dtype") == lines[3].index("bfloat16")


def test_markdown_escapes_pipes():
    md = T.to_markdown()
    assert "| sum\\|x | float32 |  |" in md


def test_json_and_csv_round_trip():
    rows = json.loads(T.to_json())["rows"]
    assert rows[0] == {"op": "mm", "dtype": "bfloat16", "error": 0.5}
    parsed = list(csv.reader(io.StringIO(T.to_csv())))
    assert parsed[0] == ["op", "dtype", "error"] and parsed[2] == ["sum|x", "float32", ""]


def test_html_escapes_cells():
    html = Table(("a",), (("<b>",),)).to_html()
    assert "&lt;b&gt;" in html and "<b>" not in html


def test_render_rejects_unknown_formats():
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        T.render("xml")


def test_rows_must_fit_the_columns():
    with pytest.raises(ValueError, match="2 cells for 1 columns"):
        Table(("a",), ((1, 2),))


def test_where_and_column_and_records():
    assert T.where(op="mm").column("dtype") == [torch.bfloat16]
    assert from_records(T.records()).rows == T.rows
