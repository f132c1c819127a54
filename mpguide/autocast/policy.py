"""Probe autocast's per-op behaviour on a device and dtype, classify each op, tabulate.

Each op (by default every op this torch registers an autocast kernel for, see
:func:`registered`; :data:`CATALOGUE` holds hand-written calls a page may pick from) runs
under :func:`torch.autocast` three ways: with float32 inputs,
with low-precision inputs, and (for ops with several floating inputs) with the first input in
low precision and the rest in float32. A dispatch mode records the casts autocast inserts.
The class comes from what happened, not from a list:

- ``lower precision``: float32 inputs come out in the low-precision dtype;
- ``float32``: low-precision inputs come out in float32;
- ``promote``: mixed inputs are cast to the widest dtype before the op;
- ``unchanged``: autocast casts nothing, the op keeps the dtypes it was given;
- ``unsupported``: the op raises under autocast on uniform inputs (the error is kept):
  autocast refuses it, or the kernel refuses the dtype;
- ``needs hardware``: on a simulated device, what neither the dispatch rules nor the CPU can
  tell (see :func:`probe_op`): the meta kernel raised and autocast's casts do not settle the
  class, or the meta kernel accepts inputs the real CPU kernel rejects and this device's
  autocast hands the kernel those same inputs.

The casts counted are those autocast added: casts the same call also makes outside autocast
(inside an op's own decomposition) are not autocast's.

Any device type this build has autocast kernels for can be probed: live where the machine has
it, otherwise simulated with fake tensors under that device's autocast (see
:func:`mpguide.autocast.device.target`). Every result says which.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map

from mpguide import error_line
from mpguide.autocast import device as _device
from mpguide.core import dtypes
from mpguide.core.table import Table

LOWER, FLOAT32, PROMOTE, UNCHANGED, UNSUPPORTED, NEEDS_HARDWARE = (
    "lower precision",
    "float32",
    "promote",
    "unchanged",
    "unsupported",
    _device.NEEDS_HARDWARE,
)
CLASSES = (LOWER, FLOAT32, PROMOTE, UNCHANGED, UNSUPPORTED, NEEDS_HARDWARE)


class Inputs:
    """Makes seeded float32 inputs on one device for the catalogue's ops (on a simulated
    device, fake tensors: no values, no generator)."""

    def __init__(self, dev: torch.device, seed: int = 0, fake: bool = False):
        self.dev = dev
        self.gen = None if fake else torch.Generator(device=dev).manual_seed(seed)

    def __call__(self, *shape: int) -> torch.Tensor:
        """Standard normal values."""
        return torch.randn(*shape, generator=self.gen, device=self.dev)

    def unit(self, *shape: int) -> torch.Tensor:
        """Uniform values in [0, 1)."""
        return torch.rand(*shape, generator=self.gen, device=self.dev)

    def index(self, high: int, *shape: int) -> torch.Tensor:
        """int64 values in [0, high)."""
        return torch.randint(high, shape, generator=self.gen, device=self.dev)

    def spd(self, n: int) -> torch.Tensor:
        """A symmetric positive definite matrix."""
        a = self(n, n)
        return a @ a.T + n * torch.eye(n, device=self.dev)


@dataclass(frozen=True)
class Op:
    """One catalogue entry: how to make its inputs, and how to call it."""

    name: str
    family: str
    inputs: Callable[[Inputs], tuple]
    call: Callable[..., Any]


def _ops() -> tuple[Op, ...]:
    ops: list[Op] = []

    def add(name, family, inputs, call):
        ops.append(Op(name, family, inputs, call))

    # matmul family
    add("matmul", "matmul", lambda t: (t(8, 16), t(16, 4)), torch.matmul)
    add("mm", "matmul", lambda t: (t(8, 16), t(16, 4)), torch.mm)
    add("bmm", "matmul", lambda t: (t(2, 8, 16), t(2, 16, 4)), torch.bmm)
    add("addmm", "matmul", lambda t: (t(8, 4), t(8, 16), t(16, 4)), torch.addmm)
    add("baddbmm", "matmul", lambda t: (t(2, 8, 4), t(2, 8, 16), t(2, 16, 4)), torch.baddbmm)
    add("addbmm", "matmul", lambda t: (t(8, 4), t(2, 8, 16), t(2, 16, 4)), torch.addbmm)
    add("mv", "matmul", lambda t: (t(8, 16), t(16)), torch.mv)
    add("addmv", "matmul", lambda t: (t(8), t(8, 16), t(16)), torch.addmv)
    add("dot", "matmul", lambda t: (t(16), t(16)), torch.dot)
    add("addr", "matmul", lambda t: (t(8, 4), t(8), t(4)), torch.addr)
    add(
        "einsum",
        "matmul",
        lambda t: (t(8, 16), t(16, 4)),
        lambda a, b: torch.einsum("ij,jk->ik", a, b),
    )
    add(
        "tensordot",
        "matmul",
        lambda t: (t(4, 8, 16), t(8, 16, 2)),
        lambda a, b: torch.tensordot(a, b, dims=2),
    )
    add("linear", "matmul", lambda t: (t(8, 16), t(4, 16), t(4)), F.linear)
    add("bilinear", "matmul", lambda t: (t(8, 5), t(8, 6), t(3, 5, 6), t(3)), F.bilinear)
    add(
        "scaled_dot_product_attention",
        "matmul",
        lambda t: (t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16)),
        F.scaled_dot_product_attention,
    )
    add("matrix_power", "matmul", lambda t: (t(8, 8),), lambda a: torch.linalg.matrix_power(a, 3))
    # convolutions
    add("conv1d", "conv", lambda t: (t(1, 3, 16), t(4, 3, 3), t(4)), F.conv1d)
    add("conv2d", "conv", lambda t: (t(1, 3, 8, 8), t(4, 3, 3, 3), t(4)), F.conv2d)
    add("conv3d", "conv", lambda t: (t(1, 3, 4, 4, 4), t(4, 3, 3, 3, 3), t(4)), F.conv3d)
    add("conv_transpose1d", "conv", lambda t: (t(1, 3, 16), t(3, 4, 3), t(4)), F.conv_transpose1d)
    add(
        "conv_transpose2d",
        "conv",
        lambda t: (t(1, 3, 8, 8), t(3, 4, 3, 3), t(4)),
        F.conv_transpose2d,
    )
    add(
        "conv_transpose3d",
        "conv",
        lambda t: (t(1, 3, 4, 4, 4), t(3, 4, 3, 3, 3), t(4)),
        F.conv_transpose3d,
    )
    add("prelu", "conv", lambda t: (t(2, 4, 8), t(4)), F.prelu)
    # norms
    add(
        "layer_norm",
        "norm",
        lambda t: (t(4, 16), t(16), t(16)),
        lambda x, w, b: F.layer_norm(x, (16,), w, b),
    )
    add("rms_norm", "norm", lambda t: (t(4, 16), t(16)), lambda x, w: F.rms_norm(x, (16,), w))
    add(
        "group_norm",
        "norm",
        lambda t: (t(2, 4, 8), t(4), t(4)),
        lambda x, w, b: F.group_norm(x, 2, w, b),
    )
    add(
        "batch_norm",
        "norm",
        lambda t: (t(4, 3, 8), t(3), t(3).abs() + 1, t(3), t(3)),
        lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b),
    )
    add("instance_norm", "norm", lambda t: (t(2, 3, 8),), F.instance_norm)
    add(
        "local_response_norm",
        "norm",
        lambda t: (t(1, 4, 8),),
        lambda x: F.local_response_norm(x, 2),
    )
    add("normalize", "norm", lambda t: (t(4, 16),), F.normalize)
    add("norm", "norm", lambda t: (t(4, 16),), torch.norm)
    add("linalg.vector_norm", "norm", lambda t: (t(4, 16),), torch.linalg.vector_norm)
    add("renorm", "norm", lambda t: (t(4, 16),), lambda x: torch.renorm(x, 2, 0, 1.0))
    add("cosine_similarity", "norm", lambda t: (t(4, 16), t(4, 16)), F.cosine_similarity)
    # softmax
    add("softmax", "softmax", lambda t: (t(4, 16),), lambda x: torch.softmax(x, -1))
    add("log_softmax", "softmax", lambda t: (t(4, 16),), lambda x: torch.log_softmax(x, -1))
    add("softmin", "softmax", lambda t: (t(4, 16),), lambda x: F.softmin(x, -1))
    # reductions
    add("sum", "reduction", lambda t: (t(4, 16),), torch.sum)
    add("prod", "reduction", lambda t: (t(4, 16),), lambda x: torch.prod(x, -1))
    add("mean", "reduction", lambda t: (t(4, 16),), torch.mean)
    add("cumsum", "reduction", lambda t: (t(4, 16),), lambda x: torch.cumsum(x, -1))
    add("cumprod", "reduction", lambda t: (t(4, 16),), lambda x: torch.cumprod(x, -1))
    add("var", "reduction", lambda t: (t(4, 16),), torch.var)
    add("std", "reduction", lambda t: (t(4, 16),), torch.std)
    add("logsumexp", "reduction", lambda t: (t(4, 16),), lambda x: torch.logsumexp(x, -1))
    add("amax", "reduction", lambda t: (t(4, 16),), lambda x: torch.amax(x, -1))
    add("trace", "reduction", lambda t: (t(8, 8),), torch.trace)
    add("quantile", "reduction", lambda t: (t(64),), lambda x: torch.quantile(x, 0.5))
    add("cdist", "reduction", lambda t: (t(4, 8), t(5, 8)), torch.cdist)
    add("pdist", "reduction", lambda t: (t(4, 8),), F.pdist)
    add("dist", "reduction", lambda t: (t(16), t(16)), torch.dist)
    # pointwise math
    for fn in (
        "exp",
        "log",
        "log2",
        "log10",
        "log1p",
        "expm1",
        "rsqrt",
        "reciprocal",
        "sin",
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "erfinv",
        "sigmoid",
        "tanh",
    ):
        add(fn, "pointwise", lambda t: (t(4, 16).abs() * 0.5,), getattr(torch, fn))
    add("pow (tensor, scalar)", "pointwise", lambda t: (t(4, 16),), lambda x: torch.pow(x, 3))
    add("pow (tensor, tensor)", "pointwise", lambda t: (t(4, 16).abs(), t(4, 16)), torch.pow)
    add("relu", "pointwise", lambda t: (t(4, 16),), torch.relu)
    add("gelu", "pointwise", lambda t: (t(4, 16),), F.gelu)
    add("silu", "pointwise", lambda t: (t(4, 16),), F.silu)
    add("add", "pointwise", lambda t: (t(4, 16), t(4, 16)), torch.add)
    add("mul", "pointwise", lambda t: (t(4, 16), t(4, 16)), torch.mul)
    add("atan2", "pointwise", lambda t: (t(4, 16), t(4, 16)), torch.atan2)
    # losses
    add("mse_loss", "loss", lambda t: (t(4, 8), t(4, 8)), F.mse_loss)
    add("l1_loss", "loss", lambda t: (t(4, 8), t(4, 8)), F.l1_loss)
    add("smooth_l1_loss", "loss", lambda t: (t(4, 8), t(4, 8)), F.smooth_l1_loss)
    add("huber_loss", "loss", lambda t: (t(4, 8), t(4, 8)), F.huber_loss)
    add("cross_entropy", "loss", lambda t: (t(4, 8), t.index(8, 4)), F.cross_entropy)
    add("nll_loss", "loss", lambda t: (torch.log_softmax(t(4, 8), -1), t.index(8, 4)), F.nll_loss)
    add(
        "kl_div",
        "loss",
        lambda t: (torch.log_softmax(t(4, 8), -1), t.unit(4, 8)),
        lambda x, y: F.kl_div(x, y, reduction="batchmean"),
    )
    add(
        "binary_cross_entropy",
        "loss",
        lambda t: (t.unit(4, 8), t.unit(4, 8)),
        F.binary_cross_entropy,
    )
    add(
        "binary_cross_entropy_with_logits",
        "loss",
        lambda t: (t(4, 8), t.unit(4, 8)),
        F.binary_cross_entropy_with_logits,
    )
    add("poisson_nll_loss", "loss", lambda t: (t(4, 8), t.unit(4, 8)), F.poisson_nll_loss)
    add("soft_margin_loss", "loss", lambda t: (t(4, 8), t(4, 8).sign()), F.soft_margin_loss)
    add("margin_ranking_loss", "loss", lambda t: (t(8), t(8), t(8).sign()), F.margin_ranking_loss)
    add(
        "cosine_embedding_loss",
        "loss",
        lambda t: (t(4, 8), t(4, 8), t(4).sign()),
        F.cosine_embedding_loss,
    )
    add("triplet_margin_loss", "loss", lambda t: (t(4, 8), t(4, 8), t(4, 8)), F.triplet_margin_loss)
    # multi-input ops
    add("cat", "multi-input", lambda t: (t(4, 8), t(4, 8)), lambda a, b: torch.cat([a, b]))
    add("stack", "multi-input", lambda t: (t(4, 8), t(4, 8)), lambda a, b: torch.stack([a, b]))
    add("addcmul", "multi-input", lambda t: (t(4, 8), t(4, 8), t(4, 8)), torch.addcmul)
    add("addcdiv", "multi-input", lambda t: (t(4, 8), t(4, 8), t(4, 8).abs() + 1), torch.addcdiv)
    add("lerp", "multi-input", lambda t: (t(4, 8), t(4, 8), t.unit(4, 8)), torch.lerp)
    add("where", "multi-input", lambda t: (t(4, 8) > 0, t(4, 8), t(4, 8)), torch.where)
    add("cross", "multi-input", lambda t: (t(4, 3), t(4, 3)), torch.linalg.cross)
    add(
        "index_put",
        "multi-input",
        lambda t: (t(8, 4), t.index(8, 3), t(3, 4)),
        lambda x, i, v: x.index_put((i,), v),
    )
    add(
        "index_copy",
        "multi-input",
        lambda t: (t(8, 4), torch.arange(3, device=t.dev), t(3, 4)),
        lambda x, i, v: x.index_copy(0, i, v),
    )
    add(
        "scatter_add",
        "multi-input",
        lambda t: (t(4, 8), t.index(4, 4, 8), t(4, 8)),
        lambda x, i, v: x.scatter_add(0, i, v),
    )
    add(
        "grid_sample",
        "multi-input",
        lambda t: (t(1, 2, 8, 8), t.unit(1, 4, 4, 2) * 2 - 1),
        lambda x, g: F.grid_sample(x, g, align_corners=False),
    )
    # linear algebra, spectral and pooling
    add("linalg.inv", "linalg", lambda t: (t.spd(8),), torch.linalg.inv)
    add("linalg.cholesky", "linalg", lambda t: (t.spd(8),), torch.linalg.cholesky)
    add("linalg.qr", "linalg", lambda t: (t(8, 8),), lambda a: torch.linalg.qr(a).Q)
    add("linalg.solve", "linalg", lambda t: (t.spd(8), t(8, 2)), torch.linalg.solve)
    add("linalg.eigh", "linalg", lambda t: (t.spd(8),), lambda a: torch.linalg.eigh(a).eigenvalues)
    add("fft.rfft", "linalg", lambda t: (t(4, 16),), torch.fft.rfft)
    add("avg_pool2d", "pooling", lambda t: (t(1, 2, 8, 8),), lambda x: F.avg_pool2d(x, 2))
    add("avg_pool3d", "pooling", lambda t: (t(1, 2, 4, 4, 4),), lambda x: F.avg_pool3d(x, 2))
    add("max_pool2d", "pooling", lambda t: (t(1, 2, 8, 8),), lambda x: F.max_pool2d(x, 2))
    add(
        "interpolate (bilinear)",
        "pooling",
        lambda t: (t(1, 2, 4, 4),),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    )
    add("embedding", "pooling", lambda t: (t.index(10, 4), t(10, 8)), F.embedding)
    return tuple(ops)


CATALOGUE: tuple[Op, ...] = _ops()


@dataclass(frozen=True)
class Run:
    """What one call gave: the output dtype, the casts autocast inserted, or the error, and
    every op that reached the dispatcher under autocast."""

    out: torch.dtype | None
    casts: tuple[tuple[torch.dtype, torch.dtype], ...]
    error: str | None = None
    warning: str | None = None
    calls: tuple[dtypes.Call, ...] = field(default=(), repr=False, compare=False)
    error_outside: str | None = None


def _first_float(value: Any) -> torch.dtype | None:
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            return leaf.dtype
    return None


def _error(err: BaseException) -> str:
    """:func:`mpguide.error_line`, cut after its first sentence when that line is long (the
    dispatcher's "Could not run" lists every backend)."""
    line = error_line(err)
    if len(line) <= 160:
        return line
    end = line.find(". ", 40)
    return line[: end + 1] if 0 < end < 200 else line[:159] + "…"


def _call(op: Op, args: tuple, dev: _device.Target, dtype: torch.dtype | None) -> Run:
    log = dtypes.Log()
    warn_always = torch.is_warn_always_enabled()
    # Warnings torch gives once per process come every time, whatever ran before.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.set_warn_always(True)
        try:
            with _device.autocast(dev, dtype), log:
                out = op.call(*args)
        except Exception as err:  # noqa: BLE001 - an op that raises is a finding, not a failure
            return Run(None, tuple(log.conversions()), _error(err), calls=tuple(log.calls))
        finally:
            torch.set_warn_always(warn_always)
    warning = f"{caught[0].category.__name__}: {caught[0].message}" if caught else None
    return Run(_first_float(out), tuple(log.conversions()), None, warning, tuple(log.calls))


def run(op: Op, args: tuple, dev: _device.Target, dtype: torch.dtype) -> Run:
    """Call ``op`` on ``args`` under autocast for ``dev`` and ``dtype``.

    The casts kept are those autocast inserted: the ones the same call makes outside autocast
    (an op's own decomposition may cast) are taken away, and so are casts from or to another
    dtype than ``dtype`` and float32 (a kernel's own, such as quantile's float64 since 2.14,
    where the same call outside autocast raises and shows none).
    """
    inside = _call(op, args, dev, dtype)
    outside = _call(op, args, dev, None)
    own = Counter(outside.casts)
    added = []
    for c in inside.casts:
        if own[c]:
            own[c] -= 1
        elif set(c) <= {dtype, torch.float32}:  # autocast casts between these two only here
            added.append(c)
    return Run(inside.out, tuple(added), inside.error, inside.warning, inside.calls, outside.error)


def observe(
    fn: Callable[[torch.device], Any],
    dev: _device.Target | torch.device | str | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    simulate: bool = False,
) -> Run:
    """Call ``fn(device)`` under autocast on ``dev`` (live, or simulated where this machine
    lacks it; tensors ``fn`` makes are then fake) and return what came out: the output dtype,
    every op that reached the dispatcher, and the casts autocast added."""
    target = dev if isinstance(dev, _device.Target) else _device.target(dev, simulate)
    op = Op(getattr(fn, "__name__", "fn"), "", lambda t: (t.dev,), fn)
    with _device.tensors(target):
        return run(op, (target.device,), target, dtypes.autocast_dtype(dtype))


def _cast_floats(args: tuple, kinds: Sequence[torch.dtype]) -> tuple:
    it = iter(kinds)

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(next(it))
        return x

    return tree_map(cast, args)


def _n_floats(args: tuple) -> int:
    return sum(isinstance(x, torch.Tensor) and x.is_floating_point() for x in tree_leaves(args))


@dataclass(frozen=True)
class Probe:
    """One op's behaviour under autocast, and the class it falls in."""

    op: str
    family: str
    kind: str
    fp32_in: Run
    low_in: Run
    mixed_in: Run | None
    reason: str = ""
    undecided: tuple[str, ...] = ()

    @property
    def error(self) -> str | None:
        """The first error of the three runs."""
        runs = (self.fp32_in, self.low_in, self.mixed_in)
        return next((r.error for r in runs if r is not None and r.error), None)

    @property
    def note(self) -> str:
        """Why the op needs hardware, else the first error, else the first warning."""
        runs = [r for r in (self.fp32_in, self.low_in, self.mixed_in) if r is not None]
        return self.reason or self.error or next((r.warning for r in runs if r.warning), "")

    @property
    def casts(self) -> tuple[str, ...]:
        """The distinct casts autocast inserted, as ``src->dst``, over all three runs."""
        seen: dict[str, None] = {}
        for r in (self.fp32_in, self.low_in, self.mixed_in):
            for src, dst in r.casts if r else ():
                seen[f"{dtypes.name(src)}->{dtypes.name(dst)}"] = None
        return tuple(seen)


def _real(dt: torch.dtype | None) -> torch.dtype | None:
    return dt.to_real() if dt is not None and dt.is_complex else dt


def classify(fp32_in: Run, low_in: Run, mixed_in: Run | None, dtype: torch.dtype) -> str:
    """The class of an op from its three runs (see the module's docstring).

    An op that raises only on mixed inputs keeps the class its uniform runs give: autocast
    did not reconcile the dtypes, and the probe's error column says so.
    """
    if fp32_in.error or low_in.error:
        return UNSUPPORTED
    if _real(fp32_in.out) == dtype:
        return LOWER
    if _real(low_in.out) == torch.float32:
        return FLOAT32
    if mixed_in is not None and (dtype, torch.float32) in mixed_in.casts:
        return PROMOTE
    return UNCHANGED


RUNS = ("fp32_in", "low_in", "mixed_in")


def _run_all(op: Op, dev: _device.Target, dtype: torch.dtype, seed: int) -> tuple:
    """The three runs of one op: float32, low-precision and (two or more floating inputs) mixed
    inputs. Inputs that cannot be made on the device count as an error of every run."""
    with _device.tensors(dev):
        try:
            args = op.inputs(Inputs(dev.device, seed, fake=dev.simulated))
        except Exception as err:  # noqa: BLE001 - reported in the probe
            failed = Run(None, (), f"inputs: {_error(err)}", error_outside=_error(err))
            return failed, failed, None
        n = _n_floats(args)
        fp32_in = run(op, _cast_floats(args, [torch.float32] * n), dev, dtype)
        low_in = run(op, _cast_floats(args, [dtype] * n), dev, dtype)
        mixed_in = (
            run(op, _cast_floats(args, [dtype] + [torch.float32] * (n - 1)), dev, dtype)
            if n >= 2
            else None
        )
    return fp32_in, low_in, mixed_in


@dataclass(frozen=True)
class Reference:
    """One op on the CPU, run for real and simulated: what a simulated device's run of the same
    op is checked against."""

    real: tuple
    fake: tuple


def _gap(i: int, sim: Run, ref: Reference) -> str | None:
    """Why run ``i`` of a simulated device cannot be trusted, or ``None``. The CPU tells: where
    this device's autocast treats the inputs as the CPU's does (the same casts), the meta kernel
    gets what the CPU kernel got; where it casts nothing, the kernel gets the inputs as given,
    as the CPU kernel does outside autocast. A cell is undecided only where, for those inputs,
    the real CPU kernel raises or returns another dtype while the meta kernel does not."""
    real, fake = ref.real[i], ref.fake[i]
    if real is None or fake is None or sim.error:
        return None
    if sim.casts == real.casts:
        if real.error and not fake.error:
            return f"the CPU kernel raises ({real.error}) where the meta kernel runs"
        if not real.error and not fake.error and real.out != fake.out:
            return f"the CPU kernel returns {real.out} where the meta kernel returns {fake.out}"
    elif not sim.casts and real.error_outside and not fake.error_outside:
        return (
            f"the CPU kernel refuses these inputs outside autocast ({real.error_outside}) where "
            "the meta kernel takes them; this device's kernel may refuse them too"
        )
    return None


def _decided_by_casts(i: int, r: Run, dtype: torch.dtype) -> str | None:
    """The class that the casts autocast inserted before the kernel raised settle, if any:
    float32 inputs cast to ``dtype`` (lower precision), ``dtype`` ones cast to float32."""
    if i == 0 and (torch.float32, dtype) in r.casts:
        return LOWER
    if i == 1 and (dtype, torch.float32) in r.casts:
        return FLOAT32
    return None


def _same_error(real: Run | None, fake: Run) -> bool:
    """Whether the real CPU kernel, outside autocast, raised the exception type the simulated
    run raised (torch words the meta and CPU checks differently)."""
    if real is None or not real.error_outside or not fake.error:
        return False
    return real.error_outside.split(":", 1)[0] == fake.error.split(":", 1)[0]


def probe_op(
    op: Op,
    dev: _device.Target,
    dtype: torch.dtype,
    seed: int = 0,
    ref: Reference | None = None,
) -> Probe:
    """Run one op the three ways and classify it.

    On a simulated device, checked against the CPU (``ref``):

    - a run whose meta kernel may differ from a real kernel (see :func:`_gap`) is undecided;
      the class stands where the decided runs settle it (``lower precision`` from the float32
      run, and so on), else the op ``needs hardware``;
    - an op that raises with autocast off as well has no meta kernel for these inputs: the
      casts autocast inserted before it raised settle the class where they can; where
      autocast cast nothing and the real CPU kernel raises the same error, the kernel refuses
      the dtype (``unsupported``); else it ``needs hardware``.

    An op that raises only under autocast is refused by autocast itself, a rule of this build.
    """
    runs = _run_all(op, dev, dtype, seed)
    fp32_in, low_in, mixed_in = runs
    kind = classify(fp32_in, low_in, mixed_in, dtype)
    if not dev.simulated or ref is None:
        return Probe(op.name, op.family, kind, *runs)
    gaps = {RUNS[i]: why for i, r in enumerate(runs) if r and (why := _gap(i, r, ref))}
    if kind in (LOWER, FLOAT32, PROMOTE) and mixed_in is not None and mixed_in.casts:
        gaps.pop("mixed_in", None)  # autocast made the inputs one dtype before the kernel
    reason = ""
    if kind == UNSUPPORTED:
        i = 0 if fp32_in.error else 1
        failed = runs[i]
        real = ref.real[i]
        if failed.error_outside:
            settled = _decided_by_casts(i, failed, dtype) or (
                i == 0 and _decided_by_casts(1, low_in, dtype)
            )
            if settled:
                kind = settled
                reason = (
                    f"from the casts autocast inserted; the meta kernel then raised: "
                    f"{failed.error_outside}"
                )
            elif (
                i == 1
                and not failed.casts
                and _same_error(real, failed)
                and not ref.real[0].error_outside
            ):
                reason = (
                    f"the kernel refuses the dtype; the real CPU kernel too: {real.error_outside}"
                )
            else:
                kind, reason = NEEDS_HARDWARE, f"the meta kernel raises: {failed.error_outside}"
    if kind not in (UNSUPPORTED, NEEDS_HARDWARE):
        settles = {LOWER: "fp32_in", FLOAT32: "low_in", PROMOTE: "mixed_in"}.get(kind)
        if settles in gaps or (kind == UNCHANGED and {"fp32_in", "low_in"} & set(gaps)):
            kind, reason = NEEDS_HARDWARE, gaps[settles or next(r for r in RUNS if r in gaps)]
        elif gaps:
            reason = "; ".join(f"{r.replace('_in', ' in')}: {why}" for r, why in gaps.items())
    return Probe(op.name, op.family, kind, *runs, reason, tuple(sorted(gaps)))


@functools.cache
def references(dtype: torch.dtype, ops: tuple[Op, ...]) -> dict[str, Reference]:
    """Every op of ``ops`` run on the CPU for real and simulated, under ``dtype`` autocast."""
    live, fake = _device.target("cpu"), _device.target("cpu", simulate=True)
    return {
        op.name: Reference(_run_all(op, live, dtype, 0), _run_all(op, fake, dtype, 0)) for op in ops
    }


def meta_gaps(dtype: torch.dtype, ops: tuple[Op, ...]) -> dict[str, dict[str, str]]:
    """Where the simulated CPU cannot be trusted: the runs (of :data:`RUNS`) whose real CPU
    kernel raises under CPU autocast, or returns another dtype, while the meta kernel runs;
    maps op name to ``{run: reason}``."""
    gaps: dict[str, dict[str, str]] = {}
    for name, ref in references(dtype, ops).items():
        for i, run_name in enumerate(RUNS):
            if ref.fake[i] is not None and (why := _gap(i, ref.fake[i], ref)):
                gaps.setdefault(name, {})[run_name] = why
    return gaps


@dataclass(frozen=True)
class Policy:
    """Autocast's behaviour for every probed op on one device and low-precision dtype."""

    device: str
    dtype: torch.dtype
    machine: _device.Machine
    probes: tuple[Probe, ...] = field(repr=False)
    how: str = _device.LIVE

    def __getitem__(self, op: str) -> Probe:
        for p in self.probes:
            if p.op == op:
                return p
        raise KeyError(op)

    def has(self, op: str) -> bool:
        """Whether ``op`` was probed."""
        return any(p.op == op for p in self.probes)

    def kind(self, op: str) -> str:
        """The class of one op."""
        return self[op].kind

    def ops(self, kind: str) -> list[str]:
        """The ops in one class, in catalogue order."""
        return [p.op for p in self.probes if p.kind == kind]

    def counts(self) -> dict[str, int]:
        """How many ops fall in each class (every class listed, zeros included)."""
        c = Counter(p.kind for p in self.probes)
        return {k: c.get(k, 0) for k in CLASSES}

    @property
    def caption(self) -> str:
        return (
            f"autocast({self.device!r}, dtype={dtypes.name(self.dtype)}): "
            f"{len(self.probes)} ops, {self.machine.caption()}; {self.how}"
        )

    def table(self, kind: str | None = None) -> Table:
        """The probes as a table grouped by class (or one class only); the last column says
        how the results were obtained."""
        low = dtypes.name(self.dtype)
        columns = (
            "op",
            "family",
            "class",
            "float32 in",
            f"{low} in",
            "mixed in",
            "casts",
            "note",
            "obtained",
        )
        order = {k: i for i, k in enumerate(CLASSES)}
        rows = tuple(
            (
                p.op,
                p.family,
                p.kind,
                *(_out(getattr(p, r), r in p.undecided) for r in RUNS),
                ", ".join(p.casts),
                p.note,
                self.how,
            )
            for p in sorted(self.probes, key=lambda p: order[p.kind])
            if kind is None or p.kind == kind
        )
        return Table(columns, rows, self.caption)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}: {n}" for k, n in self.counts().items())
        return f"{self.caption}\n{counts}\n\n{self.table().to_text()}"

    def _repr_html_(self) -> str:
        parts = [f"<p><strong>{escape(self.caption)}</strong></p>"]
        for kind, n in self.counts().items():
            if n:
                t = self.table(kind)
                keep = [i for i, c in enumerate(t.columns) if c not in ("class", "obtained")]
                rows = tuple(tuple(r[i] for i in keep) for r in t.rows)
                parts.append(f"<p><em>{escape(kind)}</em>: {n} ops</p>")
                parts.append(Table(tuple(t.columns[i] for i in keep), rows).to_html())
        return "".join(parts)


def _out(r: Run | None, undecided: bool = False) -> str:
    if r is None:
        return ""
    if undecided:
        return NEEDS_HARDWARE
    return "error" if r.error else dtypes.name(r.out) if r.out else "-"


def registered() -> tuple[Op, ...]:
    """A probe call for every op this build registers an autocast kernel for that has one
    (see :mod:`mpguide.autocast.catalogue`)."""
    from mpguide.autocast import catalogue

    return catalogue.ops()


def probe(
    dev: _device.Target | torch.device | str | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    ops: Sequence[Op] | None = None,
    seed: int = 0,
    simulate: bool = False,
) -> Policy:
    """Probe every op of ``ops`` under autocast on ``dev`` (default: :func:`mpguide.autocast.device.pick`).

    A device type this machine lacks, or any with ``simulate=True``, is simulated from this
    build's dispatch rules (see :func:`mpguide.autocast.device.target`); the result says so.
    """
    dtype = dtypes.autocast_dtype(dtype)
    ops = registered() if ops is None else ops
    target = dev if isinstance(dev, _device.Target) else _device.target(dev, simulate)
    refs = references(dtype, tuple(ops)) if target.simulated else {}
    probes = tuple(probe_op(op, target, dtype, seed, refs.get(op.name)) for op in ops)
    return Policy(target.device.type, dtype, target.describe(), probes, target.how)


def differences(a: Policy, b: Policy) -> Table:
    """The ops whose class differs between two policies: bf16 and fp16 on one device, or one
    dtype on two devices (a simulated device against the real one, say)."""
    if a.dtype != b.dtype:
        na, nb = dtypes.name(a.dtype), dtypes.name(b.dtype)
        where = f"on {a.device}"
    else:
        na, nb = _device.label(a.device, a.how), _device.label(b.device, b.how)
        where = f"for {dtypes.name(a.dtype)}"
    rows = tuple(
        (pa.op, pa.family, pa.kind, pb.kind, pb.note or pa.note)
        for pa, pb in zip(a.probes, b.probes, strict=True)
        if pa.kind != pb.kind
    )
    return Table(("op", "family", na, nb, "note"), rows, f"ops whose class differs {where}")


@dataclass(frozen=True)
class Devices:
    """One dtype's policy on several devices, side by side."""

    dtype: torch.dtype
    policies: tuple[Policy, ...] = field(repr=False)

    def __getitem__(self, device: str) -> Policy:
        for p in self.policies:
            if p.device == device:
                return p
        raise KeyError(device)

    @property
    def labels(self) -> tuple[str, ...]:
        """``cpu (ran on hardware)``, ``cuda (simulated)``, ... in column order."""
        return tuple(_device.label(p.device, p.how) for p in self.policies)

    @property
    def caption(self) -> str:
        simulated = [p.device for p in self.policies if p.how == _device.SIMULATED]
        how = f"; simulated ({', '.join(simulated)}): {_device.SIMULATED}" if simulated else ""
        return (
            f"autocast classes per device, dtype={dtypes.name(self.dtype)}, "
            f"torch {torch.__version__}{how}"
        )

    def _differs(self, i: int) -> bool:
        return len({p.probes[i].kind for p in self.policies} - {NEEDS_HARDWARE}) > 1

    def table(self) -> Table:
        """Every op's class, one column per device, and whether the class differs between
        devices that decided it (a :data:`NEEDS_HARDWARE` cell is not a difference)."""
        rows = tuple(
            (
                first.op,
                first.family,
                *(p.probes[i].kind for p in self.policies),
                "yes" if self._differs(i) else "",
            )
            for i, first in enumerate(self.policies[0].probes)
        )
        differing = [r[0] for r in rows if r[-1]]
        note = f"{len(differing)} of {len(rows)} ops differ between devices: {', '.join(differing)}"
        return Table(("op", "family", *self.labels, "differs"), rows, self.caption, (note,))

    def differences(self) -> Table:
        """Only the ops whose class differs between devices."""
        t = self.table()
        return t.where(differs="yes")

    def differing(self, a: str, b: str) -> list[str]:
        """The ops whose class differs between devices ``a`` and ``b``, both decided."""
        pa, pb = self[a], self[b]
        return [
            x.op
            for x, y in zip(pa.probes, pb.probes, strict=True)
            if x.kind != y.kind and NEEDS_HARDWARE not in (x.kind, y.kind)
        ]

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def across(
    dtype: torch.dtype | str = torch.bfloat16,
    devices: Sequence[str] | None = None,
    ops: Sequence[Op] | None = None,
    simulate: bool = False,
) -> Devices:
    """Probe ``dtype`` on each of ``devices`` (default: every device type this build's
    autocast can simulate), live where present, simulated elsewhere."""
    dtype = dtypes.autocast_dtype(dtype)
    names = _device.simulated_types() if devices is None else devices
    ops = registered() if ops is None else ops
    return Devices(dtype, tuple(probe(d, dtype, ops, simulate=simulate) for d in names))
