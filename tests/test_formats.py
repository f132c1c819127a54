import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mpguide import MPGuideError
from mpguide.precision import formats


def _bits(x: torch.Tensor) -> list[int]:
    return (x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()


def _f32(*patterns: int) -> torch.Tensor:
    signed = [p - 2**32 if p >= 2**31 else p for p in patterns]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


@pytest.mark.parametrize(
    "fmt", [f for f in formats.formats() if f.dtype is not None], ids=lambda f: f.name
)
def test_rows_agree_with_finfo_and_casts(fmt):
    fi = torch.finfo(fmt.dtype)
    assert fmt.bits == fi.bits
    assert fmt.max == fi.max and fmt.smallest_normal == fi.smallest_normal
    if fmt.dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        assert fmt.eps == fi.eps
    one = torch.tensor(1.0, dtype=torch.float64)
    # eps is the gap above 1: 1 + eps survives the cast, 1 + eps / 2 is a tie that rounds to 1.
    if fmt.mantissa_bits:
        assert (one + fmt.eps).to(fmt.dtype).double() == one + fmt.eps
        assert (one + fmt.eps / 2).to(fmt.dtype).double() == one
    if fmt.smallest_subnormal is not None:
        tiny = torch.tensor(fmt.smallest_subnormal, dtype=torch.float64)
        assert tiny.to(fmt.dtype).double() == tiny
        assert (tiny / 2).to(fmt.dtype).double() == 0
    assert torch.tensor(fmt.max, dtype=torch.float64).to(fmt.dtype).double() == fmt.max


def test_the_formats_torch_has_are_all_there():
    names = [f.name for f in formats.formats()]
    assert names[:5] == ["float64", "float32", "tf32", "bfloat16", "float16"]
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(names)
    assert formats.get("bf16").mantissa_bits == 7
    assert formats.get("torch.float8_e5m2").exponent_bits == 5
    with pytest.raises(MPGuideError, match="unknown format 'fp12'"):
        formats.get("fp12")


def test_tf32_row_follows_its_definition_and_the_emulation():
    tf32 = formats.get("tf32")
    assert (tf32.sign_bits, tf32.exponent_bits, tf32.mantissa_bits) == (1, 8, 10)
    assert tf32.smallest_normal == torch.finfo(torch.float32).smallest_normal
    assert tf32.eps == 2.0**-10 and tf32.smallest_subnormal == 2.0**-136
    assert math.isclose(tf32.digits, 11 * math.log10(2))
    limits = torch.tensor([tf32.max, tf32.smallest_subnormal, 1 + tf32.eps])
    assert torch.equal(formats.round_mantissa(limits, 10), limits)
    # Halfway between max (odd mantissa) and 2^128 rounds up to infinity; just below it does not.
    halfway = torch.tensor([(2 - 2.0**-11) * 2.0**127])
    below = torch.nextafter(halfway, torch.zeros(1))
    assert torch.isinf(formats.round_mantissa(halfway, 10)).all()
    assert formats.round_mantissa(below, 10).item() == tf32.max
    assert formats.round_mantissa(torch.tensor([tf32.smallest_subnormal / 2]), 10).item() == 0


def test_table_notes_the_finfo_eps_that_disagrees():
    tab = formats.table()
    assert tab.column("format") == [f.name for f in formats.formats()]
    # torch.finfo(float8_e5m2fnuz).eps is 0.125, yet 1.125 does not survive a cast: 1.25 does.
    assert tab.notes == (
        "torch.finfo(float8_e5m2fnuz).eps is 0.125, but 2 mantissa bits give eps 0.25.",
    )
    one = torch.tensor([1.125, 1.25], dtype=torch.float64)
    assert one.to(torch.float8_e5m2fnuz).double().tolist() == [1.0, 1.25]


def test_tf32_rounds_half_to_even():
    # 1 + 2^-11 is halfway between 1 and 1 + 2^-10: the even neighbour (1) wins.
    # 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: 1 + 2^-9 is even.
    x = _f32(0x3F800000 | 0x1000, 0x3F800000 | 0x3000, 0x3F800000 | 0x1001, 0xBF800000 | 0x1000)
    assert _bits(formats.round_mantissa(x, 10)) == [0x3F800000, 0x3F804000, 0x3F802000, 0xBF800000]


def test_tf32_keeps_inf_and_nan_and_rounds_subnormals():
    x = _f32(0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00001000, 0x00001001, 0x7F7FFFFF)
    out = formats.round_mantissa(x, 10)
    assert _bits(out[:2]) == [0x7F800000, 0xFF800000]
    assert torch.isnan(out[2:4]).all()
    assert _bits(out[4:]) == [0x00000000, 0x00002000, 0x7F800000]


def test_round_mantissa_rejects_bad_input():
    with pytest.raises(MPGuideError, match="float32"):
        formats.round_mantissa(torch.zeros(2, dtype=torch.float64), 10)
    with pytest.raises(MPGuideError, match="between 0 and 23"):
        formats.round_mantissa(torch.zeros(2), 24)


finite_f32 = st.integers(0, 2**32 - 1).filter(lambda b: (b >> 23) & 0xFF != 0xFF)


@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_seven_bit_rounding_is_torchs_bfloat16_cast_bit_for_bit(patterns):
    x = _f32(*patterns)
    assert _bits(formats.round_mantissa(x, 7)) == _bits(x.to(torch.bfloat16).float())


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_round_goes_through_torchs_cast(name):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    fmt = formats.get(name)
    assert torch.equal(fmt.round(x), x.to(fmt.dtype).float())
