"""Figures in one style for every chapter: each takes a result object and returns the figure.

:mod:`~mpguide.plots.style` holds the palette, font sizes and the helpers every figure uses;
one module per chapter holds its figures, and all are importable from here
(``plots.icicle(...)``). Like matplotlib's and scikit-learn's helpers, each takes ``ax=``:
the axes to draw on (a sequence of axes for a figure of several panels, in the order its
docstring gives), returning their figure; the figure is then the caller's, so nothing
resizes it, and a single-axes figure's title and legend go on the axes. Without ``ax``
each makes its own figure.

The figure modules import the measuring modules they draw (and with them torch) inside the
functions that need them, so that ``import mpguide.plots`` loads neither torch nor matplotlib.
"""

from mpguide.plots.autocast import policy_map
from mpguide.plots.charts import bars
from mpguide.plots.compiled import METRICS, backend_bars, comparison_bars
from mpguide.plots.dtype_grids import (
    Box,
    dtype_grid,
    dtype_key,
    dtype_strips,
    graph_strips,
    log_strips,
)
from mpguide.plots.inference import latency_error, overflow_histogram
from mpguide.plots.lowbit import element_grids, error_bars, loss_curves
from mpguide.plots.models import module_errors
from mpguide.plots.numerics import bit_layout, k_sweep, matmul_error_bars, switch_effects
from mpguide.plots.style import (
    CAST_COLOUR,
    CLASS_COLOURS,
    DTYPE_COLOURS,
    FIELD_COLOURS,
    FORMAT_COLOURS,
    GROUP_COLOURS,
    LOST_COLOUR,
    OP_COLOUR,
    SAME_COLOUR,
    SERIES_COLOURS,
)
from mpguide.plots.traces import cast_costs, cast_time_by_module, icicle
from mpguide.plots.training import (
    accumulation,
    communication_costs,
    magnitude_histogram,
    running_means,
    scale_trace,
    sum_errors,
    training_curves,
    training_runs,
)

__all__ = [
    "CAST_COLOUR",
    "CLASS_COLOURS",
    "DTYPE_COLOURS",
    "FIELD_COLOURS",
    "FORMAT_COLOURS",
    "GROUP_COLOURS",
    "LOST_COLOUR",
    "METRICS",
    "OP_COLOUR",
    "SAME_COLOUR",
    "SERIES_COLOURS",
    "Box",
    "accumulation",
    "backend_bars",
    "bars",
    "bit_layout",
    "cast_costs",
    "cast_time_by_module",
    "communication_costs",
    "comparison_bars",
    "dtype_grid",
    "dtype_key",
    "dtype_strips",
    "element_grids",
    "error_bars",
    "graph_strips",
    "icicle",
    "k_sweep",
    "latency_error",
    "log_strips",
    "loss_curves",
    "magnitude_histogram",
    "matmul_error_bars",
    "module_errors",
    "overflow_histogram",
    "policy_map",
    "running_means",
    "scale_trace",
    "sum_errors",
    "switch_effects",
    "training_curves",
    "training_runs",
]
