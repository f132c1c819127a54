"""How the policy probe calls an op: seeded inputs on a device (:class:`Inputs`), an op with
the call that makes its inputs and the call that runs it (:class:`Op`), and :data:`CATALOGUE`,
hand-written calls a page may pick from (the ops this build registers come from
:mod:`mpguide.autocast.catalogue`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


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
