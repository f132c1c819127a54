"""The cast report's tables as text a person reads at the terminal's width: a cast's cause,
what the reader acts on, is never cut (:func:`fitted`), and a report without a row says so
in a line (:func:`empty`).
"""

from __future__ import annotations

from mpguide.core import terminal
from mpguide.core.table import MAX_CELL, Table, cell, escape_controls, shortened

INDENT = 4
"""How far the other cells of a row stand in below its cause, when the cause has a line of
its own."""
MOST = 480
"""The most characters of a cause on lines of its own (a few lines); a longer one, which only
a hostile trace has, is shortened and says its length."""


def _text(value: object, most: int = MAX_CELL) -> str:
    """A cell as the text output writes it (escaped, a very long one shortened and said so)."""
    return escape_controls(shortened(cell(value), most))


def _one_line_width(table: Table) -> int:
    """How wide ``table`` is with every cell whole on one line."""
    widths = [
        max([len(name), *(len(_text(v)) for v in column)])
        for name, column in zip(table.columns, zip(*table.rows, strict=True), strict=True)
    ] or [len(c) for c in table.columns]
    return sum(widths) + 2 * (len(widths) - 1)


def _condensed(table: Table) -> Table | None:
    """``table`` with each ``dtypes`` cell cut to its first direction and how many more
    (``b8->f32 +2``), and a note saying so; None when no cell has more than one."""
    if "dtypes" not in table.columns:
        return None
    k = table.columns.index("dtypes")
    rows, cut = [], False
    for row in table.rows:
        parts = row[k].split(", ") if isinstance(row[k], str) else []
        if len(parts) > 1:
            row, cut = (*row[:k], f"{parts[0]} +{len(parts) - 1}", *row[k + 1 :]), True
        rows.append(row)
    note = (
        "dtypes: the row's most frequent direction, +N how many more (a wider COLUMNS shows them)"
    )
    return Table(table.columns, tuple(rows), table.caption, (*table.notes, note)) if cut else None


def fitted(table: Table, width: int | None, lifted: str = "cause") -> str:
    """``table`` as text within ``width``: one line per row when every cell fits whole, the
    ``dtypes`` cells cut to their first direction and a count if they must (a note says
    so); else each row's ``lifted`` cell on a line of its own, whole (wrapped when longer
    than a line), and the row's other cells below it, indented, fitted as any table is."""
    if width is None or lifted not in table.columns or _one_line_width(table) <= width:
        return table.to_text(width)
    condensed = _condensed(table)
    if condensed is not None and _one_line_width(condensed) <= width:
        return condensed.to_text(width)
    k = table.columns.index(lifted)
    rest = Table(
        tuple(c for i, c in enumerate(table.columns) if i != k),
        tuple(tuple(v for i, v in enumerate(r) if i != k) for r in table.rows),
    )
    inner = max(width - INDENT, 20)
    lines = rest.to_text(inner).split("\n")
    n = len(table.rows)
    head, rows, tail = lines[:2], lines[2 : 2 + n], lines[2 + n :]
    pad = " " * INDENT
    out = terminal.wrap(escape_controls(table.caption), width) if table.caption else []
    out += [lifted, *(pad + line for line in head)]
    for row, line in zip(table.rows, rows, strict=True):
        out += terminal.wrap(_text(row[k], MOST), width)
        out.append((pad + line).rstrip())
    if tail:  # the one note of ``rest``: the columns left out, said of the whole width
        left_out = " ".join(line.strip() for line in tail)
        out += terminal.wrap(left_out.replace(f"fit {inner} ", f"fit {width} "), width)
    out += [part for note in table.notes for part in terminal.wrap(escape_controls(note), width)]
    return "\n".join(out)


def empty(table: Table, what: str, width: int | None) -> str:
    """For a table without rows: one line saying there are no ``what`` in the trace, then
    its notes (what the trace lacked, the casts kept apart)."""
    lines = [f"no {what} in this trace"]
    for note in table.notes:
        lines += terminal.wrap(escape_controls(note), width) if width else [note]
    return "\n".join(lines)
