"""One table type for every result: text, markdown, HTML, JSON and CSV renderings.

Text and markdown show control characters escaped (:func:`escape_controls`), so that names
from a trace cannot drive the terminal or forge rows; JSON is strict, with ``null`` for
non-finite numbers.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from mpguide.core import terminal

FORMATS = ("text", "markdown", "json", "csv")
ALIASES = {"table": "text"}
"""Other names of a format, kept so that older command lines still run."""

_CONTROLS = re.compile(
    "[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]"
)
"""C0 and C1 control characters, line and paragraph separators, the bidirectional overrides
and marks (LRM, RLM, ALM) and the invisible characters (zero-width spaces and joiners, the
soft hyphen, the byte order mark): what moves a terminal's cursor, sets its title or
colours, breaks, reorders or hides text."""
MAX_CELL = 120
"""The most characters of one cell (or tree field) that text and markdown show."""


def _escaped(found: re.Match) -> str:
    code = ord(found[0])
    return {10: "\\n", 13: "\\r", 9: "\\t"}.get(code) or (
        f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    )


def escape_controls(text: str) -> str:
    """``text`` with each control character written as its Python escape (``\\x1b``,
    ``\\n``): safe to print on a terminal, and one line."""
    return _CONTROLS.sub(_escaped, text)


def shortened(text: str, most: int = MAX_CELL) -> str:
    """``text`` cut to about ``most`` characters with an ellipsis and its full length:
    ``'[1, 1, 1, ...' (5,000,000 characters)``."""
    if len(text) <= most:
        return text
    return f"{text[: most - 30]}... ({len(text):,} characters)"


def _safe(texts: list[str]) -> list[str]:
    """:func:`escape_controls` of each text; the list as it is when none has a control
    character (checked in one pass)."""
    if not _CONTROLS.search("".join(texts)):
        return texts
    return list(map(escape_controls, texts))


def _is_dtype(value: Any) -> bool:
    # Without torch imported nothing is a torch.dtype: the trace commands stay torch-free.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def cell(value: Any) -> str:
    """How one value reads in a table."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    if _is_dtype(value):
        return str(value).removeprefix("torch.")
    return str(value)


def _cells(values: Sequence[Any]) -> list[str]:
    """:func:`cell` of each value of a column; a column of one plain type at C speed."""
    kinds = set(map(type, values))
    if kinds == {str}:
        return list(values)
    if kinds == {int}:
        return list(map(str, values))
    if kinds == {float}:
        return list(map("{:.4g}".format, values))
    return list(map(cell, values))


def _short(texts: list[str]) -> list[str]:
    """:func:`shortened` of each text; the list as it is when none is too long."""
    if max(map(len, texts), default=0) <= MAX_CELL:
        return texts
    return list(map(shortened, texts))


def _plain(value: Any) -> Any:
    """``value`` as JSON takes it: a dtype by name, a non-finite number as ``None``."""
    if _is_dtype(value):
        return cell(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Table:
    """Rows under named columns, with a caption saying where they were measured."""

    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    caption: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(
                    f"row {row!r} has {len(row)} cells for {len(self.columns)} columns"
                )

    def column(self, name: str) -> list[Any]:
        i = self.columns.index(name)
        return [row[i] for row in self.rows]

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def where(self, **match: Any) -> Table:
        """The rows whose named cells equal the given values."""
        idx = {self.columns.index(k): v for k, v in match.items()}
        rows = tuple(r for r in self.rows if all(r[i] == v for i, v in idx.items()))
        return Table(self.columns, rows, self.caption, self.notes)

    def to_text(self, width: int | None = None) -> str:
        """Aligned columns under a caption, the notes below. With ``width``, the table fits
        it where it can: the widest text columns are shortened from the middle
        (:func:`mpguide.core.terminal.abbreviate`), and the caption and notes are wrapped."""
        cells = [_safe(_short(_cells(column))) for column in zip(*self.rows, strict=True)] or [
            [] for _ in self.columns
        ]
        columns = _safe(list(self.columns))
        widths = [max([len(c), *map(len, col)]) for c, col in zip(columns, cells, strict=True)]
        notes = _safe(list(self.notes))
        caption = escape_controls(self.caption)
        if width is not None and sum(widths) + 2 * (len(widths) - 1) > width:
            cells = [[_short_dtypes(c) for c in col] for col in cells]
            columns = [_short_dtypes(c) for c in columns]
            widths = [max([len(c), *map(len, col)]) for c, col in zip(columns, cells, strict=True)]
            texts, widths_ = (
                [t and w > 3 for t, w in zip(self._texts(), widths, strict=True)],
                widths,
            )
            keep = [  # a column of text that says what the caption says, on every row
                i
                for i, col in enumerate(cells)
                if not (texts[i] and len(set(col)) == 1 and len(col) > 1 and col[0] in caption)
            ]
            # The most columns that fit once their names are shortened, none below a width
            # that still reads (a name cut to 12 characters is a last resort).
            for shortest, fit in [(s, n) for s in READABLE for n in range(len(keep), 0, -1)]:
                shown = keep[:fit]
                widths = _fitted(
                    [widths_[i] for i in shown], [texts[i] for i in shown], width, shortest
                )
                if sum(widths) + 2 * (fit - 1) <= width:
                    break
            cells = [_shortened(cells[i], w) for i, w in zip(shown, widths, strict=True)]
            columns = [
                terminal.abbreviate(columns[i], w) for i, w in zip(shown, widths, strict=True)
            ]
            if fit < len(keep):
                left = [self.columns[i] for i in keep[fit:]]
                notes.append(
                    f"{len(left)} column{'s' if len(left) > 1 else ''} left out to fit "
                    f"{width} characters: {', '.join(left)} (a wider COLUMNS, or --format "
                    "markdown, json or csv, shows them)"
                )
        row = "  ".join(f"{{:<{w}}}" for w in widths).format
        out = _wrapped([caption] if caption else [], width)
        out += [row(*columns).rstrip(), "  ".join("-" * w for w in widths)]
        out += [line.rstrip() for line in map(row, *cells)]
        out += _wrapped(notes, width)
        return "\n".join(out)

    def _texts(self) -> list[bool]:
        """Per column, whether it holds names (text that may be shortened), not numbers."""
        kinds = [set(map(type, col)) - {type(None)} for col in zip(*self.rows, strict=True)]
        return [bool(k) and k <= {str} for k in kinds] or [False] * len(self.columns)

    def to_markdown(self) -> str:
        def esc(s: str) -> str:
            return escape_controls(s).replace("|", "\\|")

        out = [f"**{escape_controls(self.caption)}**", ""] if self.caption else []
        out.append("| " + " | ".join(esc(c) for c in self.columns) + " |")
        out.append("|" + "---|" * len(self.columns))
        out += ["| " + " | ".join(esc(shortened(cell(v))) for v in row) + " |" for row in self.rows]
        out += ["", *map(escape_controls, self.notes)] if self.notes else []
        return "\n".join(out)

    def to_html(self) -> str:
        head = "".join(f"<th>{escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{escape(cell(v))}</td>" for v in row) + "</tr>"
            for row in self.rows
        )
        cap = f"<caption>{escape(self.caption)}</caption>" if self.caption else ""
        notes = "".join(f"<p><small>{escape(n)}</small></p>" for n in self.notes)
        return (
            f'<div class="mpguide-table"><table class="table">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>{notes}</div>"
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "caption": self.caption,
                "notes": list(self.notes),
                "rows": [{k: _plain(v) for k, v in r.items()} for r in self.records()],
            },
            indent=2,
            allow_nan=False,
        )

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(self.columns)
        writer.writerows([cell(v) for v in row] for row in self.rows)
        return buf.getvalue()

    def render(self, fmt: str, width: int | None = None) -> str:
        """Render as one of :data:`FORMATS` (or an alias of one, :data:`ALIASES`); text fits
        ``width`` where it can."""
        fmt = ALIASES.get(fmt, fmt)
        if fmt == "text":
            return self.to_text(width)
        renderers = {
            "markdown": self.to_markdown,
            "json": self.to_json,
            "csv": self.to_csv,
        }
        if fmt not in renderers:
            raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
        return renderers[fmt]()

    def __repr__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        return self.to_html()


READABLE = (16, 12)
"""The fewest characters a shortened column keeps: columns are left out before names are cut
below the first, and the second is the last resort."""


def _fitted(widths: list[int], texts: list[bool], width: int, shortest: int) -> list[int]:
    """Column widths that fit ``width`` with two spaces between columns: the widest text
    columns are cut to one cap, none below ``shortest`` (so a table of many numeric columns
    may still be wider)."""
    room = width - 2 * (len(widths) - 1)
    fixed = sum(w for w, t in zip(widths, texts, strict=True) if not t)
    names = sorted((w for w, t in zip(widths, texts, strict=True) if t), reverse=True)
    if fixed + sum(names) <= room or not names:
        return widths
    cap = max(names)
    while cap > shortest and fixed + sum(min(w, cap) for w in names) > room:
        cap -= 1
    return [min(w, cap) if t else w for w, t in zip(widths, texts, strict=True)]


_DTYPES = re.compile(r"\b(?:b?float|u?int)(?:8|16|32|64)\b")


def _short_dtypes(text: str) -> str:
    """Dtype names in the graphs' notation (``bfloat16`` -> ``bf16``), which text output
    uses when the full names do not fit."""
    if "float" not in text and "int" not in text:
        return text
    return _DTYPES.sub(lambda m: m[0].replace("float", "f").replace("int", "i"), text)


def _shortened(cells: list[str], most: int) -> list[str]:
    return [terminal.abbreviate(c, most) for c in cells]


def _wrapped(lines: list[str], width: int | None) -> list[str]:
    if width is None:
        return lines
    return [part for line in lines for part in terminal.wrap(line, width)]


def from_records(records: Sequence[dict[str, Any]], caption: str = "", notes=()) -> Table:
    """A table whose columns are the keys of the first record."""
    columns = tuple(records[0]) if records else ()
    return Table(
        columns, tuple(tuple(r[c] for c in columns) for r in records), caption, tuple(notes)
    )
