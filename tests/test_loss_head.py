"""The loss head computed several ways, and peak bytes at the dispatcher
(mpguide.training.loss_head, mpguide.training.peak_bytes)."""

import pytest
import torch

from mpguide.training import loss_head
from mpguide.training.peak_bytes import PeakBytes


def test_peak_bytes_counts_what_is_alive_at_once():
    a = torch.randn(1000)
    with PeakBytes() as mem:
        b = a * 2
        c = b + 1
        del b
        d = c.view(-1) * 3
    assert mem.peak == 2 * 4000 and mem.live == 2 * 4000
    del c, d


@pytest.fixture(scope="module")
def head_inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g).bfloat16()
    w = (torch.randn(512, 32, generator=g) / 4).bfloat16()
    return h, w, torch.randint(0, 512, (64,), generator=g)


def test_float_logits_beat_bf16_and_chunks_match_them_with_less_memory(head_inputs):
    bf16 = loss_head.measure("bf16", loss_head.bf16_logits, *head_inputs)
    upcast = loss_head.measure("float", loss_head.float_logits, *head_inputs)
    chunks = loss_head.measure("chunks", loss_head.chunked(4), *head_inputs)
    assert bf16.loss_dtype == torch.bfloat16 and upcast.loss_dtype == torch.float32
    assert upcast.loss_error < bf16.loss_error
    assert chunks.loss_error == pytest.approx(upcast.loss_error, abs=1e-5)
    assert chunks.peak_bytes < upcast.peak_bytes


def test_torch_linear_cross_entropy_reference_path_is_linear_then_cross_entropy(head_inputs):
    head = loss_head.torch_linear_cross_entropy()
    if head is None:
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
    ref = loss_head.measure("lce", head, *head_inputs)
    plain = loss_head.measure("bf16", loss_head.bf16_logits, *head_inputs)
    assert ref.loss_error == plain.loss_error and ref.loss_dtype == plain.loss_dtype
