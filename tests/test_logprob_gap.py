"""The train/serve logprob gap of a tiny LM (mpguide.training.logprob_gap)."""

import pytest
import torch

from mpguide import MPGuideError
from mpguide.training import logprob_gap

CFG = logprob_gap.TinyLMConfig(vocab=256, width=32, heads=2, layers=1)


@pytest.fixture(scope="module")
def setup():
    model = logprob_gap.TinyLM(CFG).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab, (2, 16), generator=g)
    return model, tokens, logprob_gap.sample_targets(model, tokens, 1.0, g)


def test_same_seed_same_model():
    a, b = logprob_gap.TinyLM(CFG), logprob_gap.TinyLM(CFG)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_float32_sides_agree_and_bf16_sides_do_not(setup):
    model, tokens, targets = setup
    P = logprob_gap.Path
    f32 = logprob_gap.logprobs(model, tokens, targets, P("a"))
    assert f32.dtype == torch.float64 and bool((f32 <= 0).all())
    same = logprob_gap.gap(f32, logprob_gap.logprobs(model, tokens, targets, P("b")), ("a", "b"))
    assert same.mean_abs == 0 and same.outside_band == 0
    trainer = logprob_gap.logprobs(model, tokens, targets, P("t", autocast=torch.bfloat16))
    server = logprob_gap.logprobs(model, tokens, targets, P("s", weights=torch.bfloat16))
    bf16 = logprob_gap.gap(trainer, server, ("t", "s"))
    assert 0 < bf16.mean_abs <= bf16.max_abs
    assert model.lm_head.weight.dtype == torch.float32  # the server cast a copy


def test_gap_refuses_other_shapes():
    with pytest.raises(MPGuideError, match="shapes differ"):
        logprob_gap.gap(torch.zeros(2), torch.zeros(3), ("a", "b"))
