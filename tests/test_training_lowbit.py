import pytest
import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.precision import recipes
from mpguide.training import lowbit


def _layer(q, rht=None, seed=0):
    torch.manual_seed(seed)
    plain = nn.Linear(64, 32)
    return plain, lowbit.QuantLinear(plain, q, rht)


def test_with_exact_operands_the_three_gemms_are_linears():
    plain, quant = _layer(lambda t, role: t, rht=torch.Generator().manual_seed(0))
    x = torch.randn(40, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    quant(x).square().sum().backward()
    weight_grad, bias_grad = plain.weight.grad.clone(), plain.bias.grad.clone()
    plain.zero_grad()
    plain(x2).square().sum().backward()
    # The Hadamard transform cancels in the weight gradient (up to float32 rounding).
    torch.testing.assert_close(weight_grad, plain.weight.grad, rtol=1e-5, atol=1e-4)
    assert torch.equal(bias_grad, plain.bias.grad) and torch.allclose(x.grad, x2.grad)


def test_forward_multiplies_the_quantized_operands():
    q = lowbit.quantizer(lowbit.recipe("mxfp8"), torch.Generator())
    _, quant = _layer(q)
    x = torch.randn(8, 64)
    expect = recipes.mx(x).values @ recipes.mx(quant.weight.detach()).values.T + quant.bias
    assert torch.equal(quant(x), expect)


def test_roles_and_padding():
    gen = torch.Generator().manual_seed(0)
    q = lowbit.quantizer(lowbit.recipe("fp8 blockwise"), gen)
    w = torch.randn(100, 200)  # neither dimension a multiple of 128: padded with zeros
    assert q(w, "w").shape == w.shape
    tiles = recipes.fp8(nn.functional.pad(w, (0, 56, 0, 28)), "blockwise_128x128").values
    assert torch.equal(q(w, "w"), tiles[:100, :200])
    sr = lowbit.quantizer(lowbit.recipe("nvfp4", sr=True), gen)
    g = torch.randn(4, 128)
    assert not torch.equal(sr(g, "g"), sr(g, "g")) and torch.equal(sr(g, "x"), sr(g, "x"))


def test_hadamard_is_orthonormal():
    h = lowbit.hadamard(16)
    assert torch.allclose(h @ h.T, torch.eye(16), atol=1e-6)


def test_training_shares_weights_and_batches_across_recipes():
    runs = lowbit.train(
        [lowbit.recipe("bf16"), lowbit.recipe("nvfp4", keep=("2", "6"))], steps=3, batch=16
    )
    assert [len(r.losses) for r in runs] == [3, 3]
    assert runs[0].losses[0] == pytest.approx(runs[1].losses[0], rel=0.05)
    assert runs[1].name == "nvfp4 (bf16 2, 6)"


def test_bad_recipes_are_one_line():
    with pytest.raises(MPGuideError, match="unknown training recipe 'fp3'"):
        lowbit.recipe("fp3")
    with pytest.raises(MPGuideError, match="no linear layer named 9"):
        lowbit.train([lowbit.recipe("mxfp8", keep=("9",))], steps=1)
