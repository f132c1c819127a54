import math

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import formats, lowbit

# The facts of each format as its specification states them (OCP OFP8 and MX v1.0):
# max, smallest positive value, positive subnormals, NaN codes, infinities.
SPEC = {
    "float8_e4m3fn": (448, 2**-9, 7, 2, False),
    "float8_e5m2": (57344, 2**-16, 3, 6, True),
    "float8_e8m0fnu": (2**127, 2**-127, 0, 1, False),
    "fp6_e2m3": (7.5, 0.125, 7, 0, False),
    "fp6_e3m2": (28, 0.0625, 3, 0, False),
    "fp4_e2m1": (6, 0.5, 1, 0, False),
}


@pytest.mark.parametrize("name", SPEC)
def test_facts_from_the_codes_match_the_specs(name):
    fmt = lowbit.get(name)
    assert len(fmt.values) == 2**fmt.bits
    facts = (fmt.max, fmt.min_positive, fmt.subnormals, fmt.nan_codes, fmt.infinities)
    assert facts == SPEC[name]


def test_fp4_values_are_the_eight_magnitudes():
    magnitudes = (0, 0.5, 1, 1.5, 2, 3, 4, 6)
    assert lowbit.get("fp4").finite == (*(-m for m in reversed(magnitudes[1:])), *magnitudes)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"])
def test_every_code_decodes_as_torch_reads_it(name):
    fmt = lowbit.get(name)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    torch_values = codes.view(fmt.dtype).double().tolist()
    for ours, theirs in zip(fmt.values, torch_values, strict=True):
        assert ours == theirs or (math.isnan(ours) and math.isnan(theirs))
    known = formats.get(name)
    assert (known.max, known.smallest_normal) == (fmt.max, fmt.smallest_normal)


def _probes(fmt: lowbit.Element) -> torch.Tensor:
    """Every finite value, every midpoint and the float32 neighbours of each midpoint."""
    grid = torch.tensor(fmt.finite, dtype=torch.float64)
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    up = torch.nextafter(mids, torch.tensor(math.inf))
    down = torch.nextafter(mids, torch.tensor(-math.inf))
    return torch.cat([grid.float(), mids, up, down])


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_nearest_rounding_agrees_with_torch_casts(name):
    fmt = lowbit.get(name)
    x = _probes(fmt)
    x = x[x.abs() <= fmt.max]
    # The arithmetic (the path of saturate=False) against the cast, on in-range values.
    assert torch.equal(lowbit.round_to(x, fmt, saturate=False), x.to(fmt.dtype).float())
    # The saturating path (a clamp, then the cast) agrees with the arithmetic, saturated.
    wide = torch.cat([x, x * 1000, torch.tensor([math.inf, -math.inf])])
    arithmetic = lowbit.round_to(wide, fmt, saturate=False)
    arithmetic = torch.where(
        arithmetic.isnan() | arithmetic.isinf(), wide.sign() * fmt.max, arithmetic
    )
    assert torch.equal(lowbit.round_to(wide, fmt), arithmetic)


def test_ties_go_to_even():
    e4m3 = lowbit.get("e4m3")
    # 1.0625 lies halfway between 1.0 (mantissa 000) and 1.125 (001): even is 1.0.
    out = lowbit.round_to(torch.tensor([1.0625, 1.1875, -1.0625]), e4m3)
    assert out.tolist() == [1.0, 1.25, -1.0]


def test_overflow_saturates_or_becomes_inf_or_nan():
    x = torch.tensor([1e6, -1e6, math.inf])
    assert lowbit.round_to(x, "e5m2").tolist() == [57344, -57344, 57344]
    assert lowbit.round_to(x, "e5m2", saturate=False).tolist() == [math.inf, -math.inf, math.inf]
    assert lowbit.round_to(x, "e4m3", saturate=False).isnan().all()
    # The halfway point above e4m3's max rounds to the even 448; just past it overflows.
    past = torch.tensor([464.0, torch.nextafter(torch.tensor(464.0), torch.tensor(1e9)).item()])
    assert lowbit.round_to(past, "e4m3", saturate=False)[0] == 448
    assert lowbit.round_to(past, "e4m3", saturate=False)[1].isnan()


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = torch.full((200_000,), 1.1)
    gen = torch.Generator().manual_seed(0)
    out = lowbit.round_to(x, "e4m3", "stochastic", generator=gen)
    assert set(out.unique().tolist()) == {1.0, 1.125}
    assert abs(out.double().mean().item() - 1.1) < 1e-3
    again = lowbit.round_to(x, "e4m3", "stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_sub_byte_rounding_agrees_with_torchao():
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats import kernels

    for name, down, up in [
        ("fp4_e2m1", kernels.f32_to_f4_unpacked, kernels.f4_unpacked_to_f32),
        ("fp6_e2m3", kernels.f32_to_f6_e2m3_unpacked, kernels.f6_e2m3_unpacked_to_f32),
        ("fp6_e3m2", kernels.f32_to_f6_e3m2_unpacked, kernels.f6_e3m2_unpacked_to_f32),
    ]:
        x = _probes(lowbit.get(name))
        x = torch.cat([x, x * 3.7, torch.randn(10_000, generator=torch.Generator().manual_seed(1))])
        assert torch.equal(lowbit.round_to(x, name), up(down(x))), name


def test_bad_input_is_one_line():
    with pytest.raises(MPGuideError, match="unknown low-bit format 'fp5'"):
        lowbit.get("fp5")
    with pytest.raises(MPGuideError, match="unknown rounding"):
        lowbit.round_to(torch.ones(2), "e4m3", "up")
    with pytest.raises(MPGuideError, match="float32"):
        lowbit.round_to(torch.ones(2, dtype=torch.float64), "e4m3")
    with pytest.raises(MPGuideError, match="e8m0 holds scales"):
        lowbit.round_to(torch.ones(2), "e8m0")


def test_table_has_every_format_and_checks_finfo():
    table = lowbit.table()
    assert table.column("format") == list(lowbit.ELEMENTS)
    assert "float8_e4m3fn, float8_e5m2" in table.notes[0]
    cast = dict(zip(table.column("format"), table.column("cast past max"), strict=True))
    assert cast["float8_e5m2"] == "inf" and cast["fp4_e2m1"] == "no cast"
