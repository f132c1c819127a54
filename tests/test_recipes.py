import math

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import lowbit, recipes


def _outliers(rows: int = 256, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Normal values times log-normal magnitudes (seven decades), and one large outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp(
        3 * torch.randn(rows, cols, generator=gen)
    )
    x[3, 7] = 3e4
    return x


X = _outliers()


# --- against torchao, element for element ------------------------------------------------------


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_matches_torchao_float8(recipe, pow2):
    utils = pytest.importorskip("torchao.float8.float8_utils")
    granularity = utils.ScalingGranularity
    gran = granularity.TENSORWISE if recipe == "tensorwise" else granularity.AXISWISE
    axis = -1 if recipe == "rowwise" else None
    s = utils.tensor_to_scale(
        X, torch.float8_e4m3fn, scaling_granularity=gran, axiswise_dim=axis,
        round_scales_to_power_of_2=pow2,
    )  # fmt: skip
    data = utils.to_fp8_saturated(X * s, torch.float8_e4m3fn).float()
    q = recipes.fp8(X, recipe, pow2=pow2)
    assert torch.equal(q.elements, data)
    assert torch.equal(q.scales.flatten(), s.flatten())
    assert torch.equal(q.values, data / s)


@pytest.mark.parametrize(
    ("recipe", "tile"), [("blockwise_1x128", (1, 128)), ("blockwise_128x128", (128, 128))]
)
def test_blockwise_is_torchao_scaling_per_tile(recipe, tile):
    """torchao's blockwise reference functions import triton; its rowwise float8 scaling of the
    tiles laid out as rows is the same arithmetic (float64 amax, float32 scale, clamp, cast)."""
    utils = pytest.importorskip("torchao.float8.float8_utils")
    rows, cols = tile
    tiles = X.reshape(X.shape[0] // rows, rows, X.shape[1] // cols, cols).permute(0, 2, 1, 3)
    tiles = tiles.reshape(-1, rows * cols)
    s = utils.tensor_to_scale(
        tiles, torch.float8_e4m3fn, scaling_granularity=utils.ScalingGranularity.AXISWISE,
        axiswise_dim=-1,
    )  # fmt: skip
    data = utils.to_fp8_saturated(tiles * s, torch.float8_e4m3fn).float()
    q = recipes.fp8(X, recipe)
    ours = q.elements.reshape(X.shape[0] // rows, rows, X.shape[1] // cols, cols)
    assert torch.equal(ours.permute(0, 2, 1, 3).reshape(-1, rows * cols), data)
    assert torch.equal(q.scales.flatten(), s.flatten())


def test_blockwise_matches_torchao_blockwise_reference():
    pytest.importorskip("triton")
    kernels = pytest.importorskip("torchao.prototype.blockwise_fp8_training.kernels")
    data, inverse = kernels.torch_blockwise_scale_act_quant_lhs(X, 128)
    q = recipes.fp8(X, "blockwise_1x128")
    assert torch.equal(q.elements, data.float()) and torch.equal(1 / q.scales, inverse)
    data, inverse = kernels.torch_blockwise_scale_weight_quant(X, 128)
    q = recipes.fp8(X, "blockwise_128x128")
    assert torch.equal(q.elements, data.float()) and torch.equal(1 / q.scales, inverse)


def _torchao_mx():
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats import kernels
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    elements = {
        "mxfp8": (torch.float8_e4m3fn, lambda d: d.float()),
        "mxfp6": ("fp6_e2m3", kernels.f6_e2m3_unpacked_to_f32),
        "mxfp4": (
            torch.float4_e2m1fn_x2,
            lambda d: kernels.f4_unpacked_to_f32(kernels.unpack_uint4(d)),
        ),
    }
    return mx_tensor, ScaleCalculationMode, elements


@pytest.mark.parametrize("scale_mode", recipes.MX_SCALE_MODES)
@pytest.mark.parametrize("kind", list(recipes.MX_ELEMENTS))
def test_mx_matches_torchao(kind, scale_mode):
    mx_tensor, mode, elements = _torchao_mx()
    elem, decode = elements[kind]
    scale, data = mx_tensor.to_mx(X, elem, 32, mode(scale_mode))
    q = recipes.mx(X, kind, scale_mode=scale_mode)
    assert torch.equal(q.elements, decode(data).reshape(X.shape))
    assert torch.equal(q.scales, mx_tensor.get_fp_scale(scale).reshape(q.scales.shape))
    assert torch.equal(q.values, mx_tensor.to_dtype(data, scale, elem, 32, torch.float32))


def test_where_torchao_mx_differs_from_the_spec():
    """For a block whose scale is 2**-127 the spec divides by 2**-127; torchao's floor mode
    divides by 2**-126 (it clamps to float32's smallest normal) but dequantizes with 2**-127, so
    the block comes back halved; its rceil mode multiplies by 1 instead of 2**127 and returns
    zeros. Only blocks with amax below about 2**-118 are affected."""
    mx_tensor, mode, _ = _torchao_mx()
    x = torch.full((1, 32), 1.5 * 2.0**-119)
    q = recipes.mx(x, "mxfp8")
    assert q.scales.item() == 2.0**-127 and torch.equal(q.values, x)
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode.FLOOR)
    theirs = mx_tensor.to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
    assert torch.equal(theirs, x / 2)
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode.RCEIL)
    assert not data.float().any() and torch.equal(
        recipes.mx(x, "mxfp8", scale_mode="rceil").values, x
    )


@pytest.mark.parametrize("tensor_scale", [False, True])
def test_nvfp4_matches_torchao(tensor_scale):
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from torchao.prototype.mx_formats import kernels

    global_scale = nvfp4.per_tensor_amax_to_scale(X.abs().max()) if tensor_scale else None
    s8, data = nvfp4.nvfp4_quantize(X, 16, global_scale)
    q = recipes.nvfp4(X, tensor_scale=tensor_scale)
    elements = kernels.f4_unpacked_to_f32(kernels.unpack_uint4(data)).reshape(X.shape)
    assert torch.equal(q.elements, elements)
    scales = s8.float() if global_scale is None else global_scale * s8.float()
    assert torch.equal(q.scales, scales.reshape(q.scales.shape))


# --- the recipes' own properties ---------------------------------------------------------------


@pytest.mark.parametrize("recipe", recipes.RECIPES)
def test_values_are_elements_on_the_grid_times_scales(recipe):
    q = recipes.quantize(X, recipe)
    grid = torch.tensor(lowbit.get(q.element).finite)
    assert torch.isin(q.elements, grid).all()
    assert q.values.shape == X.shape and torch.isfinite(q.values).all()
    rel = ((q.values - X).norm() / X.norm()).item()
    assert rel < {8: 0.07, 6: 0.2, 4: 0.5}[lowbit.get(q.element).bits]


def test_mx_scales_are_powers_of_two_and_saturate_under_floor():
    q = recipes.mx(X, "mxfp8")
    assert torch.equal(q.scales, torch.exp2(torch.log2(q.scales).round()))
    # floor picks 2**(floor(log2 amax) - 8): an amax whose mantissa is above 1.75 saturates.
    x = torch.full((1, 32), 1.9)
    assert recipes.mx(x, "mxfp8").saturated.all()
    assert not recipes.mx(x, "mxfp8", scale_mode="rceil").saturated.any()


def test_scale_bits_per_value():
    expect = {"mxfp8": 8.25, "mxfp6": 6.25, "mxfp4": 4.25, "blockwise_1x128": 8.25}
    for recipe, bits in expect.items():
        assert recipes.quantize(X, recipe).bits_per_value == bits
    assert recipes.nvfp4(X).bits_per_value == 4.5 + 32 / X.numel()
    assert recipes.mx(X, "mxfp4", block=16).bits_per_value == 4.5


def test_delayed_scaling_uses_the_previous_amax():
    delayed = recipes.DelayedScaling(history=2)
    first = delayed(torch.full((4, 4), 2.0))
    assert first.scales.item() == 1.0 and torch.equal(first.values, torch.full((4, 4), 2.0))
    assert delayed.scale.item() == 448 / 2
    spike = delayed(torch.full((4, 4), 20.0))  # scaled by 224: saturates at 448 / 224 = 2
    assert spike.saturated.all() and torch.equal(spike.values, torch.full((4, 4), 2.0))
    assert delayed.scale.item() == pytest.approx(448 / 20)
    delayed(torch.ones(4, 4))
    delayed(torch.ones(4, 4))  # the spike has left the two-step history
    assert delayed.scale.item() == 448


def test_bad_input_is_one_line():
    with pytest.raises(
        MPGuideError, match=r"block size 128 does not divide the last dimension \(100\)"
    ):
        recipes.fp8(torch.ones(4, 100), "blockwise_1x128")
    with pytest.raises(MPGuideError, match="block size 32 does not divide"):
        recipes.mx(torch.ones(4, 48), "mxfp8")
    with pytest.raises(MPGuideError, match="unknown recipe 'fp3'"):
        recipes.quantize(X, "fp3")
    with pytest.raises(MPGuideError, match="unknown MX format"):
        recipes.mx(X, "mxfp5")
    with pytest.raises(MPGuideError, match="float32"):
        recipes.fp8(X.double())
    with pytest.raises(MPGuideError, match="fp8 recipes take"):
        recipes.fp8(X, fmt="fp4_e2m1")
    for message in ("block size 128 does not divide",):
        with pytest.raises(MPGuideError) as err:
            recipes.fp8(torch.ones(100, 128), "blockwise_128x128")
        assert message in str(err.value) and "\n" not in str(err.value)


def test_all_zero_tensors_quantize_to_zeros():
    zeros = torch.zeros(2, 32)
    for recipe in recipes.RECIPES[-4:]:
        assert not recipes.quantize(zeros, recipe).values.any()
    assert math.isfinite(recipes.fp8(zeros).scales.item())
