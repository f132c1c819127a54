import dataclasses
import re

import pytest
import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.core import timing
from mpguide.core.device import describe
from mpguide.models import inference


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    return nn.Sequential(encoder, nn.Flatten(), nn.Linear(16 * 4, 3))


@pytest.fixture(scope="module")
def inputs():
    return torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def comparison(model, inputs):
    return inference.compare(model, inputs, dev="cpu", warmup=1, repeat=3)


def test_standard_variants_on_cpu():
    names = [v.name for v in inference.standard("cpu")]
    assert names == ["fp32", "bf16 weights", "fp16 weights", "autocast bf16"]


def test_fp32_is_exact_and_low_precision_is_close(comparison):
    fp32 = comparison["fp32"]
    assert fp32.max_error == 0 and fp32.agreement == 1 and fp32.output == torch.float32
    for name in ("bf16 weights", "fp16 weights", "autocast bf16"):
        r = comparison[name]
        assert 0 < r.mean_error <= r.max_error < 0.1, name
        assert r.nonfinite == 0
    assert comparison["bf16 weights"].output == torch.bfloat16
    assert comparison["fp16 weights"].output == torch.float16


def test_cast_weights_halve_parameter_memory_and_autocast_does_not(comparison, model):
    full = inference.parameter_bytes(model)
    assert comparison["fp32"].parameter_bytes == full
    assert comparison["bf16 weights"].parameter_bytes * 2 == full
    assert comparison["fp16 weights"].parameter_bytes * 2 == full
    assert comparison["autocast bf16"].parameter_bytes == full


def test_peak_memory_and_latency_are_measured(comparison):
    for r in comparison.results:
        assert r.peak_bytes > 0
        assert len(r.latency.times) == 3 and r.latency.throughput > 0


def test_the_original_model_is_left_alone(comparison, model):
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.training


def test_table_has_a_row_per_variant(comparison):
    table = comparison.table()
    assert table.column("variant") == comparison.names
    assert "same class %" in table.columns and "<table" in comparison._repr_html_()
    assert repr(comparison["fp32"]).splitlines()[0].split()[0] == "variant"


def _fake(name, weights, agreement, params, times, nonfinite=0, autocast=None):
    return inference.Result(
        inference.Variant(name, weights, autocast),
        weights,
        0.0,
        0.0,
        agreement,
        nonfinite,
        params,
        1,
        timing.Latency(name, times, "cpu", 4),
    )


def _fake_comparison():
    return inference.Comparison(
        (
            _fake("fp32", torch.float32, 1.0, 100, (1.0, 1.0, 1.1, 0.9, 1.0)),
            _fake("bf16 weights", torch.bfloat16, 0.995, 50, (0.5, 0.5, 0.55, 0.45, 0.5)),
            _fake("fp16 weights", torch.float16, 1.0, 50, (0.4, 0.4, 0.4, 0.4, 0.4), nonfinite=3),
            _fake(
                "autocast bf16",
                torch.float32,
                0.9,
                100,
                (0.2, 0.2, 0.2, 0.2, 0.2),
                autocast=torch.bfloat16,
            ),
            _fake("slow", torch.float32, 1.0, 100, (1.05, 0.95, 1.0, 1.2, 1.0)),
        ),
        describe("cpu"),
        4,
    )


def test_best_skips_nonfinite_and_disagreeing_variants():
    comp = _fake_comparison()
    assert comp.best().name == "bf16 weights"
    assert comp.best(min_agreement=0.8).name == "autocast bf16"
    with pytest.raises(MPGuideError, match="no variant agrees"):
        inference.Comparison(comp.results[2:3], comp.machine, 4).best()


def test_guide_states_only_relations_that_hold():
    lines = dict(
        zip(_fake_comparison().names[1:], inference.guide(_fake_comparison()), strict=True)
    )
    assert "50% of fp32's parameter memory" in lines["bf16 weights"]
    assert "is faster" in lines["bf16 weights"]
    assert "3 non-finite logits" in lines["fp16 weights"]
    assert "keeps fp32's parameter memory" in lines["autocast bf16"]
    assert "below 99%" in lines["autocast bf16"]
    assert "not clearly faster or slower" in lines["slow"]


def test_choices_name_the_closest_smallest_and_fastest_that_keep_predictions():
    closest, least, fastest = inference.choices(_fake_comparison())
    assert closest.startswith("Closest to fp32 while keeping 99% of fp32's predicted classes:")
    assert "bf16 weights" in least and "fp16 weights" not in least  # fp16 had inf logits
    assert fastest.startswith("Fastest while keeping 99% of fp32's predicted classes: bf16")
    assert "clearly ahead of fp32" in fastest
    loose = inference.choices(_fake_comparison(), min_agreement=0.8)[2]
    assert "autocast bf16" in loose.split("(")[0] and "clearly ahead of bf16 weights" in loose


def test_choices_say_when_the_fastest_is_within_the_spread():
    comp = _fake_comparison()
    near = inference.Comparison((comp["fp32"], comp["slow"]), comp.machine, 4)
    assert "within the spreads of" in inference.choices(near)[-1]


# Importing inductor warns from inside torch 2.13 itself (torch.utils.mkldnn).
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_variant_matches_its_eager_twin(model, inputs):
    bf16 = inference.Variant("bf16 weights", torch.bfloat16)
    comp = inference.compare(
        model,
        inputs,
        [inference.Variant("fp32"), bf16, bf16.compiled()],
        dev="cpu",
        warmup=1,
        repeat=2,
    )
    compiled = comp["bf16 weights + compile"]
    assert compiled.variant.compile and compiled.output == torch.bfloat16
    assert compiled.agreement == 1.0 and compiled.max_error < 0.1


def test_bad_calls_raise_one_line_errors(model, inputs):
    with pytest.raises(MPGuideError, match="no variants"):
        inference.compare(model, inputs, [], dev="cpu")
    with pytest.raises(MPGuideError, match="names must differ"):
        inference.compare(
            model, inputs, [inference.Variant("a"), inference.Variant("a")], dev="cpu"
        )
    with pytest.raises(MPGuideError, match="returned dict, not a tensor of logits"):
        inference.compare(ReturnsDict(), inputs, dev="cpu", repeat=1)
    for out, said in [
        (Output(logits={"a": 1}), "Output whose .logits is dict, not a tensor of logits"),
        ({"logits": [1.0]}, "dict whose logits are list, not a tensor of logits"),
        ((), "an empty tuple, not logits"),
    ]:
        with pytest.raises(MPGuideError, match=f"^the model returned {re.escape(said)}$"):
            inference.compare(Returns(out), inputs, dev="cpu", repeat=1)


def test_an_output_object_with_logits_is_read(model, inputs):
    wrapped = inference.compare(Wraps(model), inputs, [inference.Variant("fp32")], dev="cpu")
    plain = inference.compare(model, inputs, [inference.Variant("fp32")], dev="cpu")
    assert wrapped.results[0].agreement == plain.results[0].agreement == 1.0
    assert wrapped.results[0].max_error == plain.results[0].max_error == 0


@dataclasses.dataclass
class Output:
    """An output that is not a mapping, with ``.logits``."""

    logits: object


class Returns(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out = out
        self.lin = nn.Linear(1, 1)

    def forward(self, x):
        return self.out


class Wraps(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return Output(self.model(x))


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"scores": x}  # an output with "logits" (a transformers model's) is read
