"""Tests of mpguide.training."""

# --- Loss scaling, optimizer precision, whole training loops ---


# --- Layers with state, recompute, communication dtypes ---
