"""The style every figure shares: one palette, font sizes, and the helpers that make a figure's
axes (or take the caller's), title it and give it a legend."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mpguide import MPGuideError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure, SubFigure
    from matplotlib.text import Text

# -- colours: one palette (seaborn's "deep"), named once ----------------------------------------
BLUE, ORANGE, GREEN, RED, PURPLE = "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2"
BROWN, PINK, GREY, CYAN = "#937860", "#da8bc3", "#8c8c8c", "#64b5cd"
LIGHT_GREY, PALE_GREY, PALE_BLUE, INK = "#d9d9d9", "#f2f2f2", "#c6d4e8", "#222222"

# One colour per autocast class, in the order of mpguide.autocast.policy.CLASSES.
CLASS_COLOURS = (BLUE, ORANGE, GREEN, LIGHT_GREY, RED, PURPLE)

# One colour per dtype, and per outcome that is not a dtype, in every dtype figure; the outcomes
# share their colour with the autocast class of the same meaning in CLASS_COLOURS.
DTYPE_COLOURS = {
    "float64": CYAN,
    "float32": BLUE,
    "bfloat16": ORANGE,
    "float16": GREEN,
    "error": RED,
    "needs hardware": PURPLE,
    "none": LIGHT_GREY,
    "other": PALE_GREY,
}
CONVERSION_EDGE = INK

# One colour per group of bars (backends, master-weight curves), and per series of a chart.
GROUP_COLOURS = (BLUE, ORANGE, GREEN, PURPLE)
SERIES_COLOURS = (BLUE, ORANGE, GREEN, PURPLE, RED, BROWN)
# The low-bit chapter's formats and recipes, up to eight.
FORMAT_COLOURS = (BLUE, ORANGE, GREEN, RED, PURPLE, BROWN, PINK, GREY)

# The bit fields of a format.
FIELD_COLOURS = {"sign": RED, "exponent": BLUE, "mantissa": GREEN}
# A value that is lost or wrong is red, a cast is orange, an op is pale blue, "the same" grey.
CAST_COLOUR, OP_COLOUR, LOST_COLOUR, SAME_COLOUR = ORANGE, PALE_BLUE, RED, LIGHT_GREY

# -- font sizes (points) ------------------------------------------------------------------------
TINY, SMALL, TEXT, TITLE, HEADING = 6.5, 7, 8, 9, 10


# -- axes -----------------------------------------------------------------------------------------


def axes(ax: Axes | None, figsize: tuple[float, float], **kw: Any) -> tuple[Figure, Axes, bool]:
    """The axes to draw on: ``ax`` and its figure, or a new figure of ``figsize`` (constrained
    layout, ``kw`` passed to :func:`matplotlib.pyplot.subplots`) with one axes; and whether the
    figure is new (the figure-level title and legend go on the figure only then)."""
    if ax is not None:
        return ax.figure, ax, False
    import matplotlib.pyplot as plt

    fig, new = plt.subplots(figsize=figsize, **{"layout": "constrained", **kw})
    return fig, new, True


def grid(
    ax: Axes | Sequence[Axes] | None,
    nrows: int,
    ncols: int,
    figsize: tuple[float, float],
    **kw: Any,
) -> tuple[Figure, list[Axes], bool]:
    """:func:`axes` for a figure of ``nrows`` x ``ncols`` axes, as a flat list (row by row):
    ``ax`` must then hold that many axes, all on one figure."""
    if ax is not None:
        import numpy as np

        given = list(np.ravel(np.array(ax, dtype=object)))
        if len(given) != nrows * ncols:
            raise MPGuideError(f"this figure draws on {nrows * ncols} axes; ax holds {len(given)}")
        if len({id(a.figure) for a in given}) > 1:
            raise MPGuideError("the axes in ax are on different figures")
        return given[0].figure, given, False
    import matplotlib.pyplot as plt

    fig, made = plt.subplots(
        nrows, ncols, figsize=figsize, squeeze=False, **{"layout": "constrained", **kw}
    )
    return fig, list(made.flat), True


# -- titles and legends ---------------------------------------------------------------------------


def value_axis(ax: Axes, label: str, grid: bool = True) -> None:
    """The house style of an axes whose y axis reads values: ``label`` and tick labels in text
    size, light horizontal grid lines (``grid``), no top or right spine."""
    ax.set_ylabel(label, fontsize=TEXT)
    ax.tick_params(axis="y", labelsize=TEXT)
    if grid:
        ax.grid(True, axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def width(fig: Figure | SubFigure) -> float:
    """The width of a figure, or of a subfigure the caller drew on, in inches."""
    if hasattr(fig, "get_figwidth"):
        return fig.get_figwidth()
    return fig.bbox.width / fig.figure.dpi


def fig_title(fig: Figure, text: str, fontsize: float = TITLE) -> Text | None:
    """A title over the whole figure, wrapped to its width (none for an empty ``text``)."""
    if not text:
        return None
    chars = int(width(fig) * 72 / (0.6 * fontsize))
    return fig.suptitle(textwrap.fill(text, chars), fontsize=fontsize)


def heading(fig: Figure, ax: Axes, own: bool, text: str) -> Text | None:
    """The figure's title (:func:`fig_title`) on a figure this module made, else ``ax``'s title
    (left-aligned), so that a figure the caller composes keeps its own."""
    if own:
        return fig_title(fig, text)
    return ax.set_title(text, fontsize=TITLE, loc="left") if text else None


def legend_below(fig: Figure, ax: Axes, own: bool, handles: Sequence[Any] | None, **kw: Any):
    """A legend under the axes of a figure this module made, else right of ``ax``, in one
    column (``ncol`` is then dropped)."""
    kw = {"fontsize": TEXT, "frameon": False, **kw}
    if handles is not None:
        kw["handles"] = handles
    if own:
        return fig.legend(loc="outside lower center", **kw)
    kw.pop("ncol", None)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), **kw)


def as_float64(values: Any) -> Any:
    """``values`` (numbers, arrays, tensors on any device, or a sequence of tensors of one
    shape) as a float64 numpy array."""
    import numpy as np
    import torch

    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float64).numpy()
    if isinstance(values, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in values):
        return np.stack([as_float64(v) for v in values])
    return np.asarray(values, dtype=float)
