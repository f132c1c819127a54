"""Scaling recipes for low-bit formats, emulated bit-exactly on any device: one function per
recipe, each taking float32 values and returning a :class:`Quantized` (the elements, their scales
and the dequantized values).

- fp8 ``tensorwise``, ``rowwise``, ``blockwise`` (1×128 activations, 128×128 weights): one
  float32 scale ``s = fp8 max / amax`` per block (amax in float64, at least 1e-12), optionally
  rounded down to a power of two; elements ``round(clamp(x * s))``, values ``elements / s``
  (torchao's float8 training and blockwise code).
- :class:`DelayedScaling`: the scale comes from the largest amax of the previous steps
  (Transformer Engine's amax history), so this step's outliers saturate.
- ``mx``: OCP MX v1.0, a power-of-two e8m0 scale per block of 32 along the last dimension,
  ``2**(floor(log2 amax) - emax_elem)`` (``floor``, the spec's) or
  ``2**ceil(log2(amax / max_elem))`` (``rceil``, cuBLAS's); elements saturate. A block whose
  scale is ``2**-127`` is scaled by it, as the spec says; torchao 0.18 halves such blocks
  (floor) or zeroes them (rceil), which only blocks with amax below about ``2**-118`` meet.
- ``nvfp4``: fp4 e2m1 elements, an e4m3 scale per block of 16 and a float32 tensor scale
  ``amax / (448 * 6)`` (torchao's arithmetic order).

Bad input (an unknown format, a block size that does not divide the dimension) raises
:class:`~mpguide.MPGuideError` with one line.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from mpguide import MPGuideError
from mpguide.precision import lowbit

FP8_EPS = 1e-12
"""The smallest amax an fp8 scale is computed from (torchao's ``EPS``)."""
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise_1x128", "blockwise_128x128")
MX_ELEMENTS = {"mxfp8": "float8_e4m3fn", "mxfp6": "fp6_e2m3", "mxfp4": "fp4_e2m1"}
MX_SCALE_MODES = ("floor", "rceil")


@dataclass(frozen=True)
class Quantized:
    """Values quantized under one recipe.

    ``elements`` are the low-bit values (float32, on the element format's grid), ``scales``
    one float32 per block in the recipe's convention: for the fp8 recipes the factor ``x`` was
    multiplied by (values = elements / scales), for MX and NVFP4 the factor the elements are
    multiplied by (values = elements × scales). ``saturated`` marks the values that were
    clamped to the element format's max, ``scale_bits`` is what the scales cost per value."""

    recipe: str
    element: str
    values: torch.Tensor
    elements: torch.Tensor
    scales: torch.Tensor
    saturated: torch.Tensor
    scale_bits: float

    @property
    def bits_per_value(self) -> float:
        return lowbit.get(self.element).bits + self.scale_bits


def _blocked(x: torch.Tensor, rows: int | None, cols: int | None) -> torch.Tensor:
    """``x`` viewed as ``(R, rows, C, cols)`` blocks of its 2-D form (leading dims folded
    into rows); ``None`` means the whole dimension."""
    if x.dtype != torch.float32:
        raise MPGuideError(f"recipes take float32 tensors, got {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise MPGuideError(f"recipes need a non-empty tensor, got shape {tuple(x.shape)}")
    flat = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    n_rows, n_cols = flat.shape
    rows, cols = rows or n_rows, cols or n_cols
    for size, dim, which in ((rows, n_rows, "rows"), (cols, n_cols, "last dimension")):
        if dim % size:
            raise MPGuideError(
                f"block size {size} does not divide the {which} ({dim}) of shape {tuple(x.shape)}"
            )
    return flat.reshape(n_rows // rows, rows, n_cols // cols, cols)


Rounding = tuple[str, "torch.Generator | None"]
"""How elements are rounded: one of :data:`mpguide.precision.lowbit.ROUNDINGS`, and the
generator of stochastic rounding."""


def _round(scaled: torch.Tensor, fmt: lowbit.Element, rounding: Rounding) -> torch.Tensor:
    """Elements clamped to ±max, then rounded onto the grid."""
    how, generator = rounding
    return lowbit.round_to(scaled.clamp(-fmt.max, fmt.max), fmt, how, generator=generator)


def _amax(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.abs().amax(dim=(1, 3), keepdim=True)


def _fp8_element(name: str) -> lowbit.Element:
    fmt = lowbit.get(name)
    if fmt.bits != 8 or fmt.specials == "e8m0":
        raise MPGuideError(f"fp8 recipes take float8_e4m3fn or float8_e5m2, not {name!r}")
    return fmt


def _scaled_fp8(
    recipe: str,
    x: torch.Tensor,
    blocks: torch.Tensor,
    s: torch.Tensor,
    fmt: lowbit.Element,
    rounding: Rounding = ("nearest", None),
) -> Quantized:
    scaled = blocks * s
    elements = _round(scaled, fmt, rounding)
    per_block = blocks[0, :, 0, :].numel()
    return Quantized(
        recipe=recipe,
        element=fmt.name,
        values=(elements / s).reshape(x.shape),
        elements=elements.reshape(x.shape),
        scales=s.reshape(s.shape[0], s.shape[2]),
        saturated=(scaled.abs() > fmt.max).reshape(x.shape),
        scale_bits=32 / per_block,
    )


def fp8_scale(amax: torch.Tensor, fmt: lowbit.Element, pow2: bool = False) -> torch.Tensor:
    """The float32 scale ``fp8 max / amax`` (amax at least :data:`FP8_EPS`, divided in
    float64), rounded down to a power of two if ``pow2``."""
    s = (fmt.max / amax.double().clamp(min=FP8_EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if pow2 else s


def fp8(
    x: torch.Tensor,
    recipe: str = "tensorwise",
    fmt: str = "float8_e4m3fn",
    *,
    pow2: bool = False,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Quantized:
    """``x`` quantized to fp8 under ``recipe`` (one of :data:`FP8_RECIPES`): one scale for the
    tensor, per row (the last dimension), per 1×128 or per 128×128 block."""
    element = _fp8_element(fmt)
    shapes = {
        "tensorwise": (None, None),
        "rowwise": (1, None),
        "blockwise_1x128": (1, 128),
        "blockwise_128x128": (128, 128),
    }
    if recipe not in shapes:
        raise MPGuideError(f"unknown fp8 recipe {recipe!r}; choose one of {', '.join(shapes)}")
    blocks = _blocked(x, *shapes[recipe])
    s = fp8_scale(_amax(blocks), element, pow2)
    return _scaled_fp8(recipe, x, blocks, s, element, (rounding, generator))


class DelayedScaling:
    """Tensorwise fp8 with the scale from an amax history (Transformer Engine's delayed
    scaling): each call quantizes with the scale computed after the previous call, then records
    this call's amax; the new scale is ``fp8 max / max(history) / 2**margin``, kept where that
    amax is zero or not finite. The first call uses scale 1."""

    def __init__(self, fmt: str = "float8_e4m3fn", history: int = 16, margin: int = 0):
        if history < 1:
            raise MPGuideError(f"the amax history needs at least one entry, got {history}")
        self.element = _fp8_element(fmt)
        self.margin = margin
        self.history: deque[float] = deque(maxlen=history)
        self.scale = torch.tensor(1.0)

    def __call__(self, x: torch.Tensor) -> Quantized:
        blocks = _blocked(x, None, None)
        out = _scaled_fp8("delayed", x, blocks, self.scale.reshape(1, 1, 1, 1), self.element)
        self.history.append(x.abs().max().item())
        amax = max(self.history)
        if 0 < amax < float("inf"):
            amax32 = torch.tensor(amax, dtype=torch.float32)
            self.scale = self.element.max / amax32 / 2**self.margin
        return out


def mx(
    x: torch.Tensor,
    kind: str = "mxfp8",
    *,
    block: int = 32,
    scale_mode: str = "floor",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Quantized:
    """``x`` quantized to an MX format (``mxfp8``, ``mxfp6``, ``mxfp4``, or ``mx`` plus any
    element name) with one e8m0 scale per ``block`` values of the last dimension."""
    name = MX_ELEMENTS.get(kind) or (kind[3:] if kind.startswith("mx_") else None)
    if name is None:
        raise MPGuideError(f"unknown MX format {kind!r}; choose one of {', '.join(MX_ELEMENTS)}")
    fmt = lowbit.get(name)
    if scale_mode not in MX_SCALE_MODES:
        raise MPGuideError(
            f"unknown MX scale mode {scale_mode!r}; choose one of {', '.join(MX_SCALE_MODES)}"
        )
    blocks = _blocked(x, 1, block)
    amax = _amax(blocks)
    if scale_mode == "floor":
        exponent_field = (amax.view(torch.int32) >> 23) & 0xFF
        biased = (exponent_field - 127 - fmt.emax).clamp(-127, 128) + 127
        biased = torch.where(torch.isnan(amax), 255, biased)
        scale = torch.ldexp(torch.ones_like(amax), biased - 127)
        scaled = blocks / scale
    else:
        descale = amax / fmt.max
        biased = (torch.ceil(torch.log2(descale)).clamp(-127, 127) + 127).to(torch.int32)
        biased = torch.where(torch.isnan(descale), 255, biased)
        scale = torch.ldexp(torch.ones_like(amax), biased - 127)
        scaled = blocks * torch.ldexp(torch.ones_like(amax), 127 - biased)
    elements = _round(scaled, fmt, (rounding, generator))
    return Quantized(
        recipe=f"mx{fmt.bits}" if kind in MX_ELEMENTS else kind,
        element=fmt.name,
        values=(elements * scale).reshape(x.shape),
        elements=elements.reshape(x.shape),
        scales=scale.reshape(scale.shape[0], scale.shape[2]),
        saturated=(scaled.abs() > fmt.max).reshape(x.shape),
        scale_bits=8 / block,
    )


def nvfp4(
    x: torch.Tensor,
    *,
    block: int = 16,
    tensor_scale: bool = True,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Quantized:
    """``x`` quantized to NVFP4: fp4 e2m1 elements, an e4m3 scale per ``block`` values of the
    last dimension and (``tensor_scale``) a float32 scale for the tensor, ``amax / (448 * 6)``,
    that the e4m3 scales are divided by. An all-zero tensor quantizes to zeros."""
    e2m1, e4m3 = lowbit.get("fp4_e2m1"), lowbit.get("float8_e4m3fn")
    blocks = _blocked(x, 1, block)
    block_scale = blocks.abs().amax(dim=3, keepdim=True) / e2m1.max
    tiny = e4m3.smallest_normal
    if tensor_scale:
        global_scale = (x.abs().max() / (e4m3.max * e2m1.max)).float()
        if global_scale == 0:
            global_scale = torch.tensor(1.0)
        s8 = lowbit.round_to((block_scale / global_scale).clamp(tiny, e4m3.max), e4m3)
        scaled = blocks * ((1.0 / global_scale) / s8)
        scale = global_scale * s8
    else:
        s8 = lowbit.round_to(block_scale.clamp(tiny, e4m3.max), e4m3)
        scaled = blocks * (1.0 / s8)
        scale = s8
    elements = _round(scaled, e2m1, (rounding, generator))
    return Quantized(
        recipe="nvfp4" if tensor_scale else "nvfp4 (no tensor scale)",
        element=e2m1.name,
        values=(elements * scale).reshape(x.shape),
        elements=elements.reshape(x.shape),
        scales=scale.reshape(scale.shape[0], scale.shape[2]),
        saturated=(scaled.abs() > e2m1.max).reshape(x.shape),
        scale_bits=8 / block + 32 / x.numel() * tensor_scale,
    )


RECIPES = (*FP8_RECIPES, "mxfp8", "mxfp6", "mxfp4", "nvfp4")
"""The recipes :func:`quantize` knows by name (delayed scaling keeps state: use
:class:`DelayedScaling`)."""


def quantize(
    x: torch.Tensor,
    recipe: str,
    *,
    block: int | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> Quantized:
    """``x`` under the recipe called ``recipe`` (one of :data:`RECIPES`), with its default
    block size or ``block`` (MX and NVFP4 only), its elements rounded by ``rounding``."""
    how = {"rounding": rounding, "generator": generator}
    if recipe in FP8_RECIPES:
        if block is not None:
            raise MPGuideError(f"{recipe} has a fixed block; block sizes are for MX and NVFP4")
        return fp8(x, recipe, **how)
    if recipe in MX_ELEMENTS:
        return mx(x, recipe, block=block or 32, **how)
    if recipe == "nvfp4":
        return nvfp4(x, block=block or 16, **how)
    raise MPGuideError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
