"""How wide the reader's terminal is, and text made to fit it.

Every command's default text output fits :func:`width` columns: names are shortened from
the middle (:func:`abbreviate`, so that both the start of a module path and its last part
stay), notes are wrapped (:func:`wrap`).
"""

from __future__ import annotations

import os
import textwrap

DEFAULT = 100
"""The width when neither ``COLUMNS`` nor a terminal says."""
MARK = "..."
"""What stands for the characters an abbreviated name leaves out."""


def width() -> int:
    """``COLUMNS`` when it is a positive number, else the width of the terminal on stdout,
    else :data:`DEFAULT`."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(1).columns or DEFAULT
    except (OSError, ValueError):  # not a terminal
        return DEFAULT


def abbreviate(text: str, most: int) -> str:
    """``text`` in at most ``most`` characters: its start and end kept, :data:`MARK` between
    (``model.layers.0.self_attn.q_proj`` -> ``model.l...f_attn.q_proj``); leading spaces
    (a nesting) kept where the name still has room."""
    if len(text) <= most:
        return text
    indent = len(text) - len(text.lstrip(" "))
    if indent and most - indent > 2 * len(MARK):  # an indented name keeps its indent
        return text[:indent] + abbreviate(text[indent:], most - indent)
    if most <= len(MARK):
        return text[:most]
    keep = most - len(MARK)
    head = keep // 3  # the end of a name tells more apart (q_proj, e4m3fn, :218)
    return text[:head] + MARK + text[len(text) - (keep - head) :]


def wrap(text: str, most: int, indent: str = "  ") -> list[str]:
    """``text`` as lines of at most ``most`` characters, the lines after the first indented;
    a word longer than a line is broken."""
    if len(text) <= most:
        return [text]
    return textwrap.wrap(
        text,
        most,
        subsequent_indent=indent,
        break_on_hyphens=False,
        drop_whitespace=True,
    ) or [text]


def code_line(line: str, most: int) -> list[str]:
    """One line of printed code in lines of at most ``most`` characters where it can: a
    signature or ``return`` of many names keeps those that fit and counts the rest
    (``..., 28 more)``), a comment is wrapped as comments, other code is wrapped with its
    continuation indented (inside brackets, where Python allows it)."""
    if len(line) <= most:
        return [line]
    indent = line[: len(line) - len(line.lstrip())]
    body = line.lstrip()
    if body.startswith("#"):
        return textwrap.wrap(
            body, most, initial_indent=indent, subsequent_indent=indent + "#   "
        ) or [line]
    for head in ("def ", "return "):
        closing = "):" if body.endswith("):") else ")" if body.endswith(")") else None
        if body.startswith(head) and ", " in body and "(" in body and closing:
            opening = body.index("(") + 1
            names = _top_level(body[opening : len(body) - len(closing)])
            for keep in range(len(names) - 1, 0, -1):
                text = (
                    f"{indent}{body[:opening]}{', '.join(names[:keep])}, ... "
                    f"{len(names) - keep} more{closing}"
                )
                if len(text) <= most:
                    return [text]
    return textwrap.wrap(
        line,
        most,
        subsequent_indent=indent + " " * 8,
        break_on_hyphens=False,
        drop_whitespace=True,
    ) or [line]


def _top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets: ``'a: f32[2, 3], b'`` -> two names."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]
