"""The fused attention kernels computed from their definition, checked against the kernels
themselves where this build runs them in float64 (the CPU's flash attention)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpguide.models import attention_reference, diff, fixes
from mpguide.training.autograd import BACKWARD, FORWARD

CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


class Attention(nn.Module):
    def __init__(self, heads=4, kv_heads=4, mask=None, causal=False):
        super().__init__()
        self.heads, self.kv_heads, self.mask, self.causal = heads, kv_heads, mask, causal
        self.q = nn.Linear(32, 32)
        self.kv = nn.Linear(32, 2 * 32 * kv_heads // heads)
        self.o = nn.Linear(32, 32)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2 * self.kv_heads, -1).transpose(1, 2).chunk(2, dim=1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=self.mask,
            is_causal=self.causal,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def _fused_raise(func, args, kwargs):
    """The kernel as a GPU's flash attention is in float64 and float32: absent."""
    if attention_reference.compared(func) is not None and any(
        isinstance(v, torch.Tensor) and v.dtype in (torch.float64, torch.float32) for v in args
    ):
        raise RuntimeError("FlashAttention only supports fp16 and bf16 (as on a GPU)")
    return func(*args, **kwargs)


MASK = torch.randn(1, 1, 8, 8)
CASES = {
    "plain": {},
    "causal": {"causal": True},
    "float mask": {"mask": MASK},
    "boolean mask": {"mask": (MASK > 0.5) | torch.eye(8, dtype=torch.bool)},  # no row empty
    "grouped heads": {"kv_heads": 2},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_definition_gives_what_the_kernel_gives(case, monkeypatch):
    torch.manual_seed(0)
    model, x = Attention(**CASES[case]), torch.randn(2, 8, 32)
    native = diff.diff(model, x, autocast="bfloat16", backward=True)
    fused = [o for o in native.ops if o.op.startswith(CPU_FLASH)]
    if not fused:
        pytest.skip(f"this build's CPU runs {case} attention without its flash kernel")
    monkeypatch.setattr(attention_reference, "kernel", _fused_raise)
    defined = diff.diff(model, x, autocast="bfloat16", backward=True)
    assert [o.op for o in defined.ops] == [o.op for o in native.ops]
    phases = set()
    for n, d in zip(native.ops, defined.ops, strict=True):
        if n.op.startswith(CPU_FLASH):
            phases.add(n.phase)
        # The kernel's backward reads its probabilities from the run's float32 log-sum-exp;
        # the definition recomputes them: the errors agree to float32's rounding, relative.
        for a, b in ((n.local, d.local), (n.inherited, d.inherited), (n.total, d.total)):
            assert (a is None) == (b is None)
            assert a is None or b == pytest.approx(a, rel=1e-4, abs=1e-12)
    assert phases == {FORWARD, BACKWARD}
    for g, h in zip(native.grads, defined.grads, strict=True):
        assert h.error == pytest.approx(g.error, rel=1e-4)
    assert defined.output.error == pytest.approx(native.output.error, rel=1e-9)


def test_a_kernel_asked_for_dropout_has_no_reference():
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    func = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    run = list(func(q, q, q, 0.0))
    assert attention_reference.reference(func, (q, q, q, 0.5), {}, run) is None
    found = attention_reference.reference(func, (q, q, q, 0.0), {}, run)
    assert torch.allclose(found[0], run[0], rtol=1e-12, atol=1e-12)
    assert attention_reference.compared(torch.ops.aten.mm.default) is None


def test_an_op_whose_exact_result_holds_minus_inf_has_a_finite_error():
    # A boolean mask becomes -inf in the scores: the same -inf in the run is no error, and the
    # op's error is over its finite values (NaN before: inf - inf).
    torch.manual_seed(0)
    model, x = Attention(mask=CASES["boolean mask"]["mask"]), torch.randn(2, 8, 32)
    found = diff.diff(model, x, autocast="bfloat16", backward=True)
    masked = [o for o in found.ops if o.op in ("aten.where.self", "aten.scalar_tensor")]
    if not masked:
        pytest.skip("this build's CPU attention takes the boolean mask as it is")
    assert all(o.local == o.total == 0 and o.inherited == 0 for o in masked)
    held, of = found.closure
    assert held == of == len([o for o in found.ops if o.local is not None])


def test_a_kept_attention_without_a_float32_kernel_is_computed_from_its_definition(monkeypatch):
    torch.manual_seed(0)
    model, x = Attention(causal=True), torch.randn(2, 8, 32)
    found = diff.diff(model, x, autocast="bfloat16")
    attention = next(s for s in found.sources() if "flash" in s.names)
    where = ((attention.module, attention.line),)
    native = fixes.fix_list(model, x, found, 0, sources=where, autocast="bfloat16", repeat=1)
    monkeypatch.setattr(attention_reference, "kernel", _fused_raise)
    defined = fixes.fix_list(model, x, found, 0, sources=where, autocast="bfloat16", repeat=1)
    (n,), (d,) = native.steps, defined.steps
    assert d.error == pytest.approx(n.error, rel=1e-5) and n.error < native.error
