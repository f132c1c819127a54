import csv
import io
import json
import math

import pytest
import torch

from mpguide.core.table import Table, escape_controls, from_records

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


def test_text_and_markdown_escape_control_characters():
    hostile = Table(
        ("op\x1b[2J", "n"),
        (("mm\x1b]0;owned\x07\n└── forged", 1), ("ok\u202etxt\x9b", 2)),
        "caption\rback",
        ("note\x00",),
    )
    for text in (hostile.to_text(), hostile.to_markdown()):
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text
        assert "\x9b" not in text and "\u202e" not in text and "\x00" not in text
        assert r"mm\x1b]0;owned\x07\n└── forged" in text and r"ok\u202etxt\x9b" in text
    assert len(hostile.to_text().splitlines()) == 6  # caption, header, rule, two rows, note
    plain = Table(("a",), (("x\ty",),))
    assert plain.to_text().splitlines()[-1] == r"x\ty"
    assert escape_controls("no controls: µ, └──, 漢字") == "no controls: µ, └──, 漢字"


def test_json_is_strict_with_null_for_non_finite_numbers():
    odd = Table(("x", "y"), ((math.inf, [math.nan, 1.0]), (-math.inf, 2.5)))
    text = odd.to_json()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text)["rows"] == [{"x": None, "y": [None, 1.0]}, {"x": None, "y": 2.5}]
