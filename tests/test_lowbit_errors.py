import math

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import lowbit_errors


def test_plain_casts_count_overflow_and_recipes_do_not():
    x = torch.tensor([1.0, 1000.0, 1e-9, 0.0])
    cast = lowbit_errors.quantize(x, "float8_e4m3fn")
    assert cast.overflow == 0.25 and cast.saturated == 0.0
    assert cast.to_zero == pytest.approx(1 / 3)  # 1e-9 of three nonzero values
    scaled = lowbit_errors.quantize(x.reshape(1, 4), "tensorwise")
    assert scaled.overflow == 0.0 and scaled.values[0, 1].item() == pytest.approx(1000, rel=1e-6)
    assert scaled.snr_db == -20 * math.log10(scaled.rel_error)


def test_tables_and_sweeps_have_a_row_each():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    table = lowbit_errors.tensor_errors({"x": x}, ["mxfp8", "nvfp4"])
    assert table.column("recipe") == ["mxfp8", "nvfp4"]
    sweep = lowbit_errors.block_sweep(x, ["mxfp4"], [16, 32])
    assert sweep.column("bits/value") == [4.5, 4.25]
    gemm = lowbit_errors.gemm_errors([(8, 128, 8)], ["tensorwise", "mxfp4"])
    errors = dict(zip(gemm.column("recipe"), gemm.column("rel error"), strict=True))
    assert 0 < errors["tensorwise"] < errors["mxfp4"] < 0.5


def test_bad_targets_are_one_line():
    with pytest.raises(MPGuideError, match="unknown target 'fp5'; choose one of tensorwise"):
        lowbit_errors.quantize(torch.ones(2), "fp5")
    with pytest.raises(MPGuideError, match="no block size"):
        lowbit_errors.quantize(torch.ones(2), "fp4_e2m1", block=16)
