"""RoPE angle tables under autocast (mpguide.precision.rope_angles)."""

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import rope_angles

MATMUL, OUTER, EINSUM, MUL = rope_angles.WAYS


def test_inv_freq_starts_at_one_and_falls():
    inv = rope_angles.inv_freq(8, 10_000.0)
    assert inv.dtype == torch.float32 and inv.shape == (4,) and inv[0] == 1
    assert torch.all(inv[1:] < inv[:-1])
    with pytest.raises(MPGuideError, match="even"):
        rope_angles.inv_freq(7)


def test_every_way_gives_the_same_float32_table():
    pos, inv = torch.arange(16.0), rope_angles.inv_freq(8)
    ref = torch.outer(pos, inv)
    for way in rope_angles.WAYS:
        assert torch.equal(rope_angles.angles(pos, inv, way), ref), way
    with pytest.raises(MPGuideError, match="unknown way"):
        rope_angles.angles(pos, inv, "fft")


def test_cpu_autocast_lowers_the_matmul_only():
    dtypes = rope_angles.autocast_dtypes("cpu", torch.bfloat16)
    assert dtypes[MATMUL] == torch.bfloat16
    assert dtypes[OUTER] == dtypes[EINSUM] == dtypes[MUL] == torch.float32


def test_simulated_cuda_autocast_lowers_einsum_too():
    dtypes = rope_angles.autocast_dtypes("cuda", torch.float16)
    assert dtypes[MATMUL] == dtypes[EINSUM] == torch.float16
    assert dtypes[OUTER] == dtypes[MUL] == torch.float32


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_window_collapses_under_autocast_and_the_guard_restores_it(dt):
    bad = rope_angles.window(65_536, 64, 16, 10_000.0, MATMUL, dt)
    assert bad.dtype == dt and bad.distinct < 64 and bad.max_angle_error > 0
    fixed = rope_angles.window(65_536, 64, 16, 10_000.0, MATMUL, dt, guarded=True)
    assert fixed.dtype == torch.float32 and fixed.distinct == 64 and fixed.max_angle_error == 0
    off = rope_angles.window(65_536, 64, 16, 10_000.0, MATMUL, None)
    assert off == fixed
