"""The dtype each op family of a forward produced, read from a
:class:`mpguide.core.dtypes.Log`: what decides whether a softmax, a norm or a loss ran in
bf16 or float32 (the question FSDP2's ``MixedPrecisionPolicy`` and autocast answer apart).
"""

from __future__ import annotations

from mpguide.core import dtypes

FAMILIES: dict[str, tuple[str, ...]] = {
    "matmul": ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"),
    "softmax": ("aten._softmax",),
    "layer norm": ("aten.native_layer_norm",),
    "rms norm": ("aten._fused_rms_norm",),
    "log_softmax (cross-entropy)": ("aten._log_softmax",),
    "nll loss": ("aten.nll_loss_forward", "aten.nll_loss2d_forward"),
}
"""Op families and the ATen ops (overload names left out) that run them."""


def compute_dtypes(log: dtypes.Log) -> dict[str, str]:
    """``{family: dtypes}`` for each family of :data:`FAMILIES` the log holds: the distinct
    output dtypes of its calls, in order of appearance, joined by ``" + "``. The output, not
    the input: under CUDA autocast ``_log_softmax`` takes bf16 and computes into float32
    (``half_to_float``)."""
    seen: dict[str, dict[str, None]] = {}
    for call in log.calls:
        base = call.op.rsplit(".", 1)[0] if call.op.count(".") > 1 else call.op
        for family, ops in FAMILIES.items():
            if base in ops and call.out is not None:
                seen.setdefault(family, {})[dtypes.name(call.out)] = None
    return {family: " + ".join(found) for family, found in seen.items()}
