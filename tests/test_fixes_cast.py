"""The fix list keeps a parameter rounded before the run (a model cast whole) by itself."""

import math

import pytest
import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from mpguide import MPGuideError
from mpguide.models import diff, fixes
from mpguide.models.shadow import CAST


class Contrastive(nn.Module):
    """CLIP's head: cosine similarities times ``exp(logit_scale)``, the learned temperature
    CLIP clamps at 100. bf16 rounds log(100) to 4.59375: exp of it is 1 % off, in every logit."""

    def __init__(self):
        super().__init__()
        self.image = nn.Linear(32, 16)
        self.text = nn.Linear(32, 16)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(100.0)))

    def forward(self, images, texts):
        i = nn.functional.normalize(self.image(images), dim=-1)
        t = nn.functional.normalize(self.text(texts), dim=-1)
        return self.logit_scale.exp() * i @ t.T


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_planted_parameter_ranks_first_and_keeping_it_recovers_its_share(seed):
    torch.manual_seed(seed)
    model, inputs = Contrastive(), (torch.randn(8, 32), torch.randn(8, 32))
    found = diff.diff(model, inputs, dtype=torch.bfloat16)
    assert found.sources(CAST)[0].line == "logit_scale"
    fixed = fixes.fix_list(model, inputs, found, 1, dtype=torch.bfloat16, repeat=1)
    kept = [s for s in fixed.steps if s.module == "logit_scale"]
    assert len(kept) == 1 and kept[0].line == "cast to bfloat16" and kept[0].ops == "parameter"
    # Kept alone in float32, exp reads log(100) exact: at least 40 % of the error goes.
    assert kept[0].alone > 0.4
    assert not any("not sources the list tries" in n for n in fixed.notes)
    assert "logit_scale (cast to bfloat16): " in fixed.sentence()


def test_a_kept_parameter_is_read_exact_through_its_views_and_the_others_stay_rounded():
    # On the CPU, linear runs as addmm on the weight's transpose: the view is read exact too.
    torch.manual_seed(0)
    lin, x = nn.Linear(16, 8), torch.randn(4, 16)
    low = nn.Linear(16, 8).to(torch.bfloat16)
    with torch.no_grad():
        low.weight.copy_(lin.weight)
        low.bias.copy_(lin.bias)
    tensors = WeakTensorKeyDictionary()
    tensors[low.weight] = lin.weight.detach()
    keep = fixes.Keep(low, set(), torch.bfloat16, tensors=tensors)
    with keep.hooked(), torch.no_grad():
        out = low(x.bfloat16())
    expected = nn.functional.linear(x.bfloat16().float(), lin.weight, low.bias.float())
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())
    assert not torch.equal(out, low(x.bfloat16()))  # the rounded weight gives another result


def test_a_rounded_buffer_can_be_named_and_an_unknown_source_is_refused():
    torch.manual_seed(0)
    model, inputs = Contrastive(), (torch.randn(8, 32), torch.randn(8, 32))
    found = diff.diff(model, inputs, dtype=torch.bfloat16)
    named = fixes.fix_list(
        model, inputs, found, 0, sources=(("text", "text.bias"),), dtype=torch.bfloat16, repeat=1
    )
    assert [(s.module, s.ops) for s in named.steps] == [("text.bias", "parameter")]
    with pytest.raises(MPGuideError, match=r"no forward or cast source text at text\.scale"):
        fixes.fix_list(model, inputs, found, 0, sources=(("text", "text.scale"),), repeat=1)
