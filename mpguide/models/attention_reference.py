"""Fused attention kernels computed in the reference dtype from what they compute.

Flash attention has kernels in fp16 and bf16 only, memory-efficient and cuDNN attention not in
float64, so the float64 shadow (:mod:`mpguide.models.shadow`) cannot run them as they are: a
model using ``scaled_dot_product_attention`` on a GPU would stop there. :func:`reference` gives
their results from the definition, ``O = softmax(q kᵀ · scale + mask) v``, and for their
backward ops ``dq``, ``dk``, ``dv`` by the chain rule through it, in the dtype of the arguments
given (autograd cannot record inside a dispatch mode, so the gradients are written out). As the
kernels do, the backward takes the row sums ``Σ dO ⊙ O`` from the output it is given: fed the
run's rounded output, it carries that rounding as inherited error; the probabilities are
recomputed from ``q`` and ``k`` rather than read from the given log-sum-exp (float32 in the run:
a difference near float32's rounding). A row every key of which is masked gives zeros, as the
fused kernels do. Only the attention output and the gradients are compared (:func:`compared`):
the kernels' other outputs (log-sum-exp, random-number state) are the run's own, and the results
are laid out in memory as the run's. Dropout is not reproduced: a kernel asked for it has no
reference here.
"""

from __future__ import annotations

from typing import Any

import torch

from mpguide.core import dtypes

_FUSED = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
)
"""The fused attention kernels of aten, forward; each has a ``_backward`` op."""


def kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func``'s own kernel on ``args``: the call the shadow and a kept op make first (tests
    replace it to make a kernel refuse a dtype, as flash attention refuses float64 on a GPU)."""
    return func(*args, **kwargs)


def _kind(func: Any) -> str | None:
    """``forward`` or ``backward`` for a fused attention kernel, else ``None``."""
    name = func._schema.name.removeprefix("aten::")
    if name in _FUSED:
        return "forward"
    if name.removesuffix("_backward") in _FUSED and name.endswith("_backward"):
        return "backward"
    return None


def compared(func: Any) -> tuple[int, ...] | None:
    """The tensor outputs of ``func`` that carry its result (the attention output, or the
    query, key and value gradients); ``None`` for any other op: all of them."""
    kind = _kind(func)
    return None if kind is None else (0,) if kind == "forward" else (0, 1, 2)


def _probabilities(q, k, mask, causal: bool, scale: float | None) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        keep = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if isinstance(mask, torch.Tensor):
        scores = (
            scores.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else scores + mask.to(scores.dtype)
        )
    return scores.softmax(-1).nan_to_num(0.0)


def _grouped(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Key or value heads repeated to the query's (grouped-query attention)."""
    groups = q.shape[-3] // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _summed(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """A repeated head's gradient summed back onto the key or value head it came from."""
    heads = kv.shape[-3]
    if grad.shape[-3] == heads:
        return grad
    return grad.unflatten(-3, (heads, grad.shape[-3] // heads)).sum(-3)


def reference(func: Any, args: tuple, kwargs: dict, run: list[torch.Tensor]) -> list | None:
    """The tensor outputs of fused attention kernel ``func`` on ``args`` (in their dtype),
    aligned with ``run``, the run's tensor outputs; the others than :func:`compared` are the
    run's own. ``None`` where ``func`` is no such kernel, asks for dropout, or its outputs do
    not line up."""
    kind = _kind(func)
    if kind is None:
        return None
    n = dtypes.arguments(func, args, kwargs)
    if n.get("dropout_p", 0.0):
        return None
    q, k, v = n["query"], n["key"], n["value"]
    mask = n.get("attn_mask", n.get("attn_bias"))
    causal, scale = bool(n.get("is_causal", False)), n.get("scale")
    kk, vv = _grouped(q, k), _grouped(q, v)
    p = _probabilities(q, kk, mask, causal, scale)
    if kind == "forward":
        found = [p @ vv]
    else:
        grad = n.get("grad_out", n.get("grad_out_")).to(q.dtype)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        dp = grad @ vv.transpose(-2, -1)
        out = n.get("out")  # the forward's output as the kernel is given it, rounded or not
        rowsum = (grad * out.to(q.dtype)).sum(-1, keepdim=True) if out is not None else None
        ds = p * (dp - ((dp * p).sum(-1, keepdim=True) if rowsum is None else rowsum))
        found = [
            ds @ kk * scale,
            _summed(ds.transpose(-2, -1) @ q * scale, k),
            _summed(p.transpose(-2, -1) @ grad, v),
        ]
    if len(run) < len(found) or any(
        f.shape != r.shape for f, r in zip(found, run[: len(found)], strict=True)
    ):
        return None
    rest = [r.to(q.dtype) if r.is_floating_point() else r for r in run[len(found) :]]
    return [_laid_out(f, r) for f, r in zip(found, run, strict=False)] + rest


def _laid_out(found: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    """``found`` in ``run``'s memory layout: the model views the kernel's output as it lies
    (flash attention's is ``(batch, sequence, heads, dim)`` in memory), and so must the shadow."""
    if found.stride() == run.stride():
        return found
    return torch.empty_like(run, dtype=found.dtype).copy_(found)  # run's strides where dense
