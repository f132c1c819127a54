"""A MoE router's top-k from bf16 and float32 logits (mpguide.precision.router_topk)."""

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import router_topk


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g).bfloat16()
    w = (torch.randn(64, 256, generator=g) / 16).bfloat16()
    return x, w


def test_bf16_logits_change_some_expert_sets_and_float32_none(inputs):
    x, w = inputs
    bf16 = router_topk.routing(x, w, 8, "bf16 gate (bf16 logits)")
    after = router_topk.routing(x, w, 8, "bf16 gate, logits .float() after")
    f32 = router_topk.routing(x, w, 8, "float32 gate (x.float(), w.float())")
    assert bf16.logits_dtype == torch.bfloat16 and after.logits_dtype == torch.float32
    assert bf16.changed > 0 and after.changed == bf16.changed
    assert f32.changed == 0 and f32.max_logit_error < 1e-4 < bf16.max_logit_error
    assert 0 < bf16.weight_moved < 1


def test_bad_input_is_one_error(inputs):
    x, w = inputs
    with pytest.raises(MPGuideError, match="unknown gate"):
        router_topk.routing(x, w, 8, "fp4 gate")
    with pytest.raises(MPGuideError, match="bf16 inputs"):
        router_topk.routing(x.float(), w, 8, "bf16 gate (bf16 logits)")


def test_out_dtype_support_says_why_on_the_cpu():
    why = router_topk.out_dtype_support(torch.device("cpu"))
    if why:  # torch 2.13 has no CPU kernel for mm.dtype; a later torch may add one
        assert "aten::mm.dtype" in why and "\n" not in why
