"""Training-loop measurements: loss scaling, optimizer precision, layers with state, recompute
and the dtypes gradients are communicated in."""

from __future__ import annotations

# --- Loss scaling, optimizer precision, whole training loops (training pages 01, 02, 06) ---


# --- Layers with state, recompute, communication dtypes (training pages 03, 04, 05) ---
