"""An emulated fp8 KV cache (mpguide.precision.fp8_kv_cache)."""

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import fp8_kv_cache


def test_scales_have_the_right_shape():
    x = torch.randn(2, 3, 5, 4)
    assert fp8_kv_cache.scale_for(x, "scale 1.0") == 1
    assert fp8_kv_cache.scale_for(x, "per-tensor amax").shape == ()
    assert fp8_kv_cache.scale_for(x, "per-head amax").shape == (1, 3, 1, 1)
    with pytest.raises(MPGuideError, match="unknown scaling"):
        fp8_kv_cache.scale_for(x, "per-token")


def test_cache_saturates_and_flushes_at_scale_one():
    x = torch.tensor([1000.0, 1.0, 1e-5, 0.0]).view(1, 1, 1, 4)
    unit = fp8_kv_cache.through_cache(x, "scale 1.0")
    assert unit.values[0, 0, 0, 0] == 448 and unit.saturated == 0.25
    assert unit.flushed == pytest.approx(1 / 3)
    amax = fp8_kv_cache.through_cache(x, "per-tensor amax")
    assert amax.saturated == 0 and amax.values[0, 0, 0, 0] == pytest.approx(1000)


def test_amax_scales_beat_scale_one_on_outliers():
    q, k, v = fp8_kv_cache.keys_values(seq=32, generator=torch.Generator().manual_seed(0))
    unit, tensor, head = fp8_kv_cache.cache_errors(q, k, v)
    assert unit.keys_saturated > 0 and unit.key_error > tensor.key_error
    assert head.values_flushed <= tensor.values_flushed <= unit.values_flushed
    assert 0 < head.output_error < 0.1
