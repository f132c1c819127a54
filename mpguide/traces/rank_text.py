"""The tables of a directory of ranks (:class:`mpguide.traces.ranks.Ranks`) as a person
reads them: times in ns, µs, ms or s, shares in %, counts with thousands separators, as the
report of one trace writes them; JSON and CSV keep the numbers in microseconds and fractions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mpguide.core.table import Table
from mpguide.core.units import duration_text
from mpguide.traces.cast_tables import percent_text

if TYPE_CHECKING:
    from mpguide.traces.ranks import Ranks

_SHARE = "share of step"


def name(figure: str) -> str:
    """A figure's name in the text: ``'cast gpu us'`` -> ``'cast GPU'``, ``'step us'`` ->
    ``'step time'``, ``'share of step'`` -> ``'CPU % of step'``."""
    if figure == _SHARE:
        return "CPU % of step"
    if not figure.endswith(" us"):
        return figure
    words = [w.upper() if w in ("cpu", "gpu") else w for w in figure[:-3].split()]
    if len(words) == 1 or words[-1] not in ("CPU", "GPU"):
        words.append("time")
    return " ".join(words)


def _count(value: Any) -> Any:
    """A count (or the median of counts, a float) with thousands separators."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _show(figure: str) -> Callable[[Any], Any]:
    """How a value of ``figure`` reads."""
    if figure == _SHARE:
        return percent_text
    if figure.endswith(" us"):
        return duration_text
    return _count


def _per_trace(table: Table) -> Table:
    shows = [_show(c) if c not in ("rank", "file") else (lambda v: v) for c in table.columns]
    rows = tuple(tuple(show(v) for show, v in zip(shows, row, strict=True)) for row in table.rows)
    return Table(tuple(map(name, table.columns)), rows, table.caption, table.notes)


def _across(ranks: Ranks) -> Table:
    """The summary across ranks: each row's values in its figure's unit, the ratio as
    ``1.28x``, and the sentence on the headline figure in the same units."""
    table = ranks.summary()
    rows, said = [], {}
    for figure, traces, most, *values, over in table.rows:
        show = _show(figure)
        shown = [show(v) for v in values]
        ratio = None if over is None else f"{over:.2f}x"
        rows.append((name(figure), traces, most, *shown, ratio))
        than = "the median" if over is None else f"{ratio} the median of"
        said[figure] = f"{most} ({name(figure)} {shown[0]}, {than} {shown[1]})"
    headline, figures = ranks.rows[0].HEADLINE
    notes = [f"{headline}: {said[f]}" for f in figures if f in said][:1]
    return Table(table.columns, tuple(rows), table.caption, tuple(notes))


def render(ranks: Ranks, fmt: str, width: int | None) -> str:
    """Both tables of ``ranks`` as :meth:`~mpguide.traces.ranks.Ranks.render` gives them,
    readable in ``text`` and ``markdown``."""
    if fmt not in ("text", "markdown"):
        return ranks.render(fmt, width)
    tables = (_per_trace(ranks.table()), _across(ranks))
    return "\n\n".join(t.render(fmt, width) for t in tables)
