"""fn and fnuz read from the same bytes (mpguide.precision.fp8_variants)."""

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import fp8_variants


def test_codes_halve_and_swap_nan():
    codes = fp8_variants.compare_codes()
    assert codes.other_ratio == 0
    assert codes.halved + codes.zeros + len(codes.nan_fn) + len(codes.nan_fnuz) == 256
    assert codes.nan_fn == (0x7F, 0xFF) and codes.nan_fnuz == (0x80,)
    assert codes.fn_negative_zero == (0x80,) and codes.zeros == 1


def test_normalize_keeps_every_value_and_reading_the_bytes_does_not():
    values = torch.tensor([448.0, -448.0, 1.0, -0.0, 0.0, 2**-9, -3.5])
    w, scale = values.to(fp8_variants.FN), torch.tensor(0.5)
    norm_w, norm_scale = fp8_variants.normalize_to_fnuz(w, scale)
    assert norm_w.dtype == fp8_variants.FNUZ and norm_scale == 1.0
    assert torch.equal(norm_w.float() * norm_scale, w.float() * scale)
    read = fp8_variants.read_as_fnuz(w).float()
    assert read.isnan()[3] and read[0] == 224
    assert fp8_variants.cast_values_to_fnuz(w).float()[:2].isnan().all()


def test_other_dtypes_are_refused():
    w = torch.ones(2, dtype=fp8_variants.FNUZ)
    for fn in (fp8_variants.read_as_fnuz, fp8_variants.cast_values_to_fnuz):
        with pytest.raises(MPGuideError, match="expected"):
            fn(w)
    with pytest.raises(MPGuideError, match="expected"):
        fp8_variants.normalize_to_fnuz(w, torch.tensor(1.0))
