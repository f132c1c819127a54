"""``diff`` with a low-bit target: every linear layer on its quantized input and weight."""

import pytest
import torch
from test_diff import Tied
from torch import nn

from mpguide import MPGuideError
from mpguide.models import diff, fixes, lowbit_report, quantizing
from mpguide.models.shadow import QUANTIZE
from mpguide.precision import lowbit_errors
from mpguide.training.autograd import FORWARD


def between_grid_points(out_features, in_features):
    """The planted hazard: a weight whose values sit halfway between two points of fp4's grid,
    ±1.25 in blocks whose largest value is 1.5 (5 and 6 once scaled: 5 rounds to 4), for NVFP4's
    blocks of 16 and MXFP4's of 32 alike."""
    w = torch.full((out_features, in_features), 1.25)
    w[:, ::16] = 1.5
    return w * torch.randn(out_features, in_features).sign() / 8


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 32)
        with torch.no_grad():
            self.b.weight.copy_(between_grid_points(64, 64))

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        return self.c(h)


def layers():
    torch.manual_seed(0)
    return Layers(), torch.randn(8, 64)


def quantize_ops(found):
    return [o for o in found.ops if o.op.startswith(QUANTIZE)]


@pytest.mark.parametrize("target", ["nvfp4", "mxfp4"])
def test_the_planted_weight_ranks_first(target):
    model, x = layers()
    found = diff.diff(model, x, target=target)
    assert found.run == f"linear layers quantized to {target}"
    top = found.sources(FORWARD)[0]
    assert top.module == "b" and top.names == f"quantize {target}×2, addmm"
    worst = found.ranked(FORWARD)[0]
    assert (
        worst.module == "b" and worst.op == f"quantize {target} (weight)" and worst.inherited == 0
    )
    # The planted weight's quantization: 5 rounds to 4, an error of a fifth on 15 of every 16
    # values, well past the others' (standard-normal weights, the layers' inputs).
    others = [o.local for o in quantize_ops(found) if o is not worst]
    assert 0.15 < worst.local < 0.2 and worst.local > 1.25 * max(others)


@pytest.mark.parametrize("target", ["nvfp4", "mxfp4", "tensorwise", "float8_e4m3fn"])
def test_every_op_closes_and_each_gemm_inherits_its_quantization(target):
    model, x = layers()
    found = diff.diff(model, x, target=target)
    held, of = found.closure
    assert held == of == len(found.ops) and len(quantize_ops(found)) == 6
    for layer in ("a", "b", "c"):
        quantized_in, quantized_weight, gemm = [o for o in found.ops if o.module == layer]
        assert quantized_in.op == f"quantize {target} (input)"
        assert quantized_weight.op == f"quantize {target} (weight)"
        assert gemm.op == "aten.addmm" and quantized_weight.inherited == 0
        # The GEMM is float32's: it adds float32 rounding, and inherits the quantization.
        assert gemm.local < 1e-6 < quantized_in.local
        # Cast without a scale, the planted weight (±1.25 / 8 and ±1.5 / 8) is e4m3's exactly.
        exact = layer == "b" and target == "float8_e4m3fn"
        assert (quantized_weight.local == 0) == exact
        assert gemm.inherited > 100 * gemm.local
    first_in = found.ops[0]
    assert first_in.inherited == 0 and first_in.local == first_in.total > 0  # x is exact


def test_each_quantized_layer_call_is_split_with_its_quantization_as_its_own_error():
    # A layer's call is re-run in float64 on the input it was called with, before the
    # quantizing hook replaced it: its local error holds its quantization, and for the first
    # layer (fed the model's exact input) it is the GEMM's whole error.
    model, x = layers()
    found = diff.diff(model, x, target="nvfp4")
    calls = {m.name: m for m in found.modules}
    held, of = found.module_closure
    assert held == of == len(found.modules)
    gemm = next(o for o in found.ops if o.module == "a" and o.op == "aten.addmm")
    assert calls["a"].inherited == 0 and calls["a"].local == pytest.approx(gemm.total, rel=1e-9)
    for layer in ("b", "c"):
        assert calls[layer].local > 1e3 * next(
            o.local for o in found.ops if o.module == layer and o.op == "aten.addmm"
        )
    assert calls["b"].local == max(calls[n].local for n in "abc")  # the planted weight's layer


def test_the_first_gemm_has_the_error_model_target_measures():
    # model --target computes each layer's GEMM on its quantized input and weight against the
    # float64 GEMM of the unquantized ones; the first layer's input is the model's own, so the
    # diff's total error of that GEMM is the same number, found another way.
    model, x = layers()
    found = diff.diff(model, x, target="nvfp4")
    report = lowbit_report.report(model, x, "nvfp4")
    gemm = next(o for o in found.ops if o.module == "a" and o.op == "aten.addmm")
    assert gemm.total == pytest.approx(report.rows[0].output_error, rel=1e-6)


class Conv1D(nn.Module):
    """transformers' Conv1D, as :func:`mpguide.models.lowbit_report.quantized` knows it: the
    weight stored ``(in, out)``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)


def test_a_conv1d_weight_is_quantized_along_its_inner_dimension():
    torch.manual_seed(0)
    model, x = Conv1D(48, 64), torch.randn(4, 64)
    found = diff.diff(model, x, target="nvfp4")
    weight = [o for o in quantize_ops(found)][1]
    expected = lowbit_errors.quantize(model.weight.t(), "nvfp4").rel_error
    assert weight.local == pytest.approx(expected, rel=1e-6)
    # Along the other dimension, 48 values a row: the number would differ.
    assert weight.local != pytest.approx(lowbit_errors.quantize(model.weight, "nvfp4").rel_error)


def test_tied_and_parametrized_weights_are_quantized_and_left_as_they_were():
    torch.manual_seed(0)
    model, ids = Tied(32), torch.randint(0, 50, (2, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = diff.diff(model, ids, target="nvfp4")
    assert [o.module for o in quantize_ops(found)] == ["mix"] * 2 + ["head"] * 2
    held, of = found.closure
    assert held == of == len([o for o in found.ops if o.local is not None])
    assert found.output.logprob is not None and found.output.logprob > 0
    assert any(n.startswith("left out: 1 Embedding") for n in found.notes)
    assert model.head.weight is model.embed.weight and "weight" not in model.mix._parameters
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The parametrized weight is quantized as it is made: its GEMM computes on it.
    weight = quantize_ops(found)[1]
    symmetric = model.mix.weight.detach()
    assert weight.local == pytest.approx(
        lowbit_errors.quantize(symmetric, "nvfp4").rel_error, rel=1e-6
    )


def test_a_block_that_does_not_divide_names_the_layer_and_leaves_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 8))
    weights = [model[0].weight, model[2].weight]
    with pytest.raises(MPGuideError, match=r"^2: block size 32 does not divide"):
        diff.diff(model, torch.randn(4, 64), target="mxfp4")
    assert [model[0].weight, model[2].weight] == weights


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": "nvfp9"}, "unknown target 'nvfp9'; choose one of tensorwise"),
        ({"target": "nvfp4", "autocast": "bf16"}, "runs the model in its own dtype"),
        ({"target": "nvfp4", "dtype": "bf16"}, "runs the model in its own dtype"),
        ({"target": "nvfp4", "backward": True}, "no straight-through estimator"),
    ],
)
def test_refused_input(kwargs, message):
    model, x = layers()
    with pytest.raises(MPGuideError, match=message):
        diff.diff(model, x, **kwargs)
    with pytest.raises(MPGuideError, match="no linear layer"):
        diff.diff(nn.Sequential(nn.ReLU()), x, target="nvfp4")


def test_the_fix_list_keeps_the_planted_layer_unquantized_first():
    model, x = layers()
    found = diff.diff(model, x, target="nvfp4")
    fixed = fixes.fix_list(model, x, found, 3, target="nvfp4", repeat=1)
    assert fixed.steps[0].module == "b" and fixed.drop(0) > 0.2
    assert {s.module for s in fixed.steps} == {"a", "b", "c"}  # the layers, not the relus
    # Kept, a layer's input and weight are not quantized: two conversions fewer, and the
    # bytes they wrote at NVFP4's bits.
    bits = [quantizing.values(t, "nvfp4")[1] for t in (torch.zeros(8, 64), model.b.weight)]
    assert fixed.steps[0].casts == -2
    assert fixed.steps[0].bytes == -(round(8 * 64 * bits[0] / 8) + round(64 * 64 * bits[1] / 8))
    # Every layer kept: only float32's rounding is left.
    assert fixed.steps[-1].error < 1e-6 < fixed.error
    with pytest.raises(MPGuideError, match="no quantized layer"):
        relu = next(s for s in found.sources() if s.names == "relu")
        fixes.fix_list(model, x, found, 0, sources=((relu.module, relu.line),), target="nvfp4")


def test_a_weight_that_is_not_a_parameter_is_refused():
    model, x = layers()
    del model.b.weight
    model.b.register_buffer("weight", torch.randn(64, 64))
    with pytest.raises(MPGuideError, match=r"^b: its weight is neither a parameter"):
        diff.diff(model, x, target="nvfp4")
