import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from mpguide import MPGuideError
from mpguide.models import diff, shadow
from mpguide.models.shadow import CAST, NoReferenceKernel
from mpguide.training.autograd import BACKWARD, FORWARD


class Rounds(nn.Module):
    """The planted cause: one op that rounds its input to a narrow dtype and back."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype).to(x.dtype)


class Net(nn.Module):
    def __init__(self, planted=torch.float16):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.planted = Rounds(planted)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(self.planted(h) * 1.5)


def net():
    torch.manual_seed(0)
    return Net(), torch.randn(4, 16)


@pytest.mark.parametrize("planted", [torch.float16, torch.bfloat16])
def test_the_planted_op_ranks_first_forward_and_backward(planted):
    torch.manual_seed(0)
    model, x = Net(planted), torch.randn(4, 16)
    found = diff.diff(model, x, dtype=torch.float32, backward=True)
    top = found.sources(FORWARD)[0]
    assert top.module == "planted" and top.names == "_to_copy×2"
    assert found.ranked(FORWARD)[0].module == "planted"
    # Rounding to planted's format: its unit roundoff bounds the local error from above,
    # float32's from below.
    unit = torch.finfo(planted).eps / 2
    assert torch.finfo(torch.float32).eps < top.local <= unit
    # The backward's cast of the gradient back to the planted format rounds it too.
    assert found.sources(BACKWARD)[0].module == "planted"


def test_local_and_inherited_bound_the_total_for_every_op():
    model, x = net()
    for kwargs in ({"dtype": torch.float32}, {"autocast": torch.bfloat16}, {"dtype": "bf16"}):
        found = diff.diff(model, x, backward=True, **kwargs)
        held, of = found.closure
        assert of == len([o for o in found.ops if o.local is not None]) and held == of > 0
    # Fed its inputs exactly (the model's input and float32 parameters), the first linear
    # layer inherits nothing: its total is its local error.
    first = next(o for o in found.ops if o.module == "a" and o.op == "aten.addmm")
    assert first.inherited > 0  # in bfloat16 the parameters are rounded before the run


def test_exact_inputs_inherit_nothing():
    model, x = net()
    found = diff.diff(model, x, dtype=torch.float32)
    first = next(o for o in found.ops if o.module == "a" and o.op == "aten.addmm")
    assert first.inherited == 0 and first.local == first.total > 0


@pytest.mark.parametrize("planted", [torch.float16, torch.bfloat16])
def test_a_widening_cast_adds_nothing_as_the_long_way_finds(planted, monkeypatch):
    # Rounds' cast back to float32 holds every value it receives: the shortcut gives it no
    # local error without running the op on the run's inputs; the long way measures none.
    def widening(found):
        back = [o for o in found.ops if o.module == "planted" and o.op == "aten._to_copy"]
        return back[1]

    model, x = Net(planted), torch.randn(4, 16)
    short = widening(diff.diff(model, x, dtype=torch.float32, backward=True))
    monkeypatch.setattr(shadow, "_widens", lambda *_: False)
    long = widening(diff.diff(model, x, dtype=torch.float32, backward=True))
    assert short.local == long.local == 0
    assert short.inherited == short.total == long.inherited == long.total > 0
    assert shadow.holds(torch.float32, planted) and not shadow.holds(planted, torch.float32)
    assert not shadow.holds(torch.bfloat16, torch.float16)  # fp16's 10 bits do not fit in 7


def test_a_cast_model_names_its_rounded_parameters_as_sources():
    model, x = net()
    found = diff.diff(model, x, dtype=torch.bfloat16)
    cast = {s.line for s in found.sources(CAST)}
    assert {"a.weight", "a.bias", "b.weight", "b.bias", "input 0"} == cast
    unit = torch.finfo(torch.bfloat16).eps / 2
    assert all(0 < s.local <= unit for s in found.sources(CAST))


def test_the_model_is_left_as_it_was():
    model, x = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    diff.diff(model, x, dtype=torch.bfloat16, backward=True)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class Tied(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.head = nn.Linear(width, 50, bias=False)
        self.head.weight = self.embed.weight
        self.mix = nn.Linear(width, width)
        parametrize.register_parametrization(self.mix, "weight", Symmetric())

    def forward(self, ids):
        return {"logits": self.head(torch.relu(self.mix(self.embed(ids))))}


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(0, 1)


def test_tied_and_parametrized_weights_have_one_gradient_each():
    torch.manual_seed(0)
    model, ids = Tied(), torch.randint(0, 50, (2, 5))
    found = diff.diff(model, ids, autocast=torch.bfloat16, backward=True)
    names = [g.name for g in found.grads]
    assert names.count("embed.weight") == 1 and "head.weight" not in names
    assert "mix.parametrizations.weight.original" in names
    assert all(g.error is not None and 0 < g.error < 0.05 for g in found.grads)
    # The parametrization's ops are placed in its own module, at its line.
    triu = [o for o in found.ops if o.op == "aten.triu"]
    assert {o.module for o in triu} == {"mix.parametrizations.weight.0"}
    assert {o.line.partition(":")[0] for o in triu} == {"test_diff.py"}
    # A dict with logits: the log-probability error in nats.
    assert found.output.logprob is not None and 0 < found.output.logprob < 0.1


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.planted = Rounds(torch.float16)

    def forward(self, x, cache):
        keys = torch.cat([*cache["keys"], self.proj(x)], dim=0)
        return self.planted(keys * cache["scale"]).sum(0)


def test_pytree_inputs_dicts_and_caches():
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(3, 8),
        "cache": {"keys": [torch.randn(2, 8), torch.randn(2, 8)], "scale": torch.tensor(3.0)},
    }
    found = diff.diff(Cached(), inputs, dtype=torch.float32)
    assert found.sources(FORWARD)[0].module == "planted"
    cast = diff.diff(Cached(), inputs, dtype=torch.bfloat16)
    assert len(cast.sources(CAST)) == 4 + 2  # four inputs, the weight and the bias


@torch.library.custom_op("mpguide_test::single_only", mutates_args=())
def single_only(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        raise NotImplementedError("\"single_only\" not implemented for 'Double'")
    return x * 2


class Single(nn.Module):
    def forward(self, x):
        return single_only(x) + 1


def test_an_op_without_a_float64_kernel_is_named_and_float32_is_offered():
    with pytest.raises(
        NoReferenceKernel,
        match=r"^mpguide_test\.single_only has no float64 "
        r"kernel on cpu.*--reference float32",
    ):
        diff.diff(Single(), torch.randn(4), autocast=torch.bfloat16)
    found = diff.diff(Single(), torch.randn(4), dtype=torch.bfloat16, reference=torch.float32)
    assert found.reference == torch.float32 and found.output.error > 0
    assert any("float32" in n for n in found.notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.float64}, "narrower than float64"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"dtype": "bf16", "autocast": "bf16"}, "not both"),
        ({"reference": torch.float16}, "float64 or float32"),
        ({"device": "meta"}, "unknown device 'meta'"),
    ],
)
def test_refused_input(kwargs, message):
    model, x = net()
    with pytest.raises(MPGuideError, match=message):
        diff.diff(model, x, **kwargs)


def test_tables_rank_and_say_more():
    model, x = net()
    found = diff.diff(model, x, dtype=torch.float32, backward=True)
    for view in diff.VIEWS:
        table = found.table(view, limit=2)
        assert len(table.rows) <= 2
        assert all(len(line) <= 100 for line in table.to_text(100).splitlines())
    assert found.table("ops", limit=1).notes[-1].startswith("... ")
    with pytest.raises(MPGuideError, match="no view"):
        found.table("layers")


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.steps.add_(1)
        y = self.lin(x)
        y.mul_(2)  # exact in any binary format: no local error
        return y


@pytest.mark.parametrize("reference", [torch.float64, torch.float32])
def test_in_place_ops_run_once_on_the_run_and_once_on_the_shadow(reference):
    torch.manual_seed(0)
    model = InPlace()
    found = diff.diff(model, torch.randn(2, 4), autocast=torch.bfloat16, reference=reference)
    assert int(model.steps) == 1
    mul = next(o for o in found.ops if o.op == "aten.mul_.Tensor")
    assert mul.local == 0 and mul.inherited > 0


def test_the_fix_list_keeps_the_planted_op_first_and_recovers_its_share():
    from mpguide.models import fixes

    model, x = net()
    found = diff.diff(model, x, dtype=torch.float32)
    fixed = fixes.fix_list(model, x, found, 3, dtype=torch.float32, repeat=1)
    first = fixed.steps[0]
    assert first.module == "planted"
    # Kept in float32, the planted rounding goes: what is left is float32's own error.
    assert fixed.drop(0) > 0.99 and first.error < 1e-6 < fixed.error
    assert first.casts == -2  # the round trip through float16: two conversions fewer
    assert fixed.sentence().startswith("in float32, of the output error: keep planted")


def test_under_autocast_keeping_both_matmuls_leaves_only_float32_logprob_error():
    from mpguide.models import fixes

    torch.manual_seed(0)
    model, ids = Tied(), torch.randint(0, 50, (2, 5))
    found = diff.diff(model, ids, autocast=torch.bfloat16)
    fixed = fixes.fix_list(model, ids, found, 2, autocast=torch.bfloat16, repeat=1)
    assert fixed.logprob is not None and {s.module for s in fixed.steps} == {"head", "mix"}
    total = sum(fixed.drop(i) for i in range(len(fixed.steps)))
    # Both matmuls in float32: only float32's rounding is left of the log-probability error.
    assert total > 0.99 and fixed.steps[-1].logprob < 1e-5
    assert all(len(line) <= 100 for line in fixed.table().to_text(100).splitlines())


@pytest.mark.slow
def test_the_chapter_pages_planted_hazard_ranks_first_and_the_fix_recovers_its_share():
    """The model of examples/model/plot_03: the page states that keeping the planted rounding
    in float32 removes more than half of the log-probability error."""
    from pathlib import Path

    from mpguide.models import fixes

    page = Path(__file__).parents[1] / "examples/model/plot_03_where_the_error_comes_from.py"
    source = page.read_text()  # the page's factory only: running the page would run it all
    factory = source[source.index("class RoundsToFloat8") : source.index("model, inputs = make()")]
    scope = {"torch": torch, "nn": nn, "transformers": pytest.importorskip("transformers")}
    exec(factory, scope)  # noqa: S102 -- the page's own factory, so the test follows the page
    model, inputs = scope["make"]()
    found = diff.diff(model, inputs, autocast=torch.bfloat16)
    assert found.sources(FORWARD)[0].module == "model.norm.1"
    fixed = fixes.fix_list(model, inputs, found, 1, autocast=torch.bfloat16, repeat=1)
    assert fixed.steps[0].module == "model.norm.1" and fixed.drop(0) > 0.5


def test_the_error_budget_draws_inherited_and_local_per_module():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpguide.plots import models as model_plots

    model, x = net()
    found = diff.diff(model, x, dtype=torch.float32)
    fig, ax = plt.subplots()
    assert model_plots.error_budget(found, modules=["a", "planted", "b"], ax=ax) is fig
    bars = list(ax.patches)
    assert len(bars) == 6  # inherited and local for each of three calls
    local = {m.name: m.local for m in found.modules}
    assert bars[4].get_height() == pytest.approx(local["planted"])
    with pytest.raises(MPGuideError, match="no module 'c'"):
        model_plots.error_budget(found, modules=["c"])
    plt.close("all")


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 128, bias=False)

    def forward(self, x):
        weights, experts = self.gate(x).softmax(-1).topk(8)
        return weights * experts.float()


def test_a_router_whose_top_k_changes_is_counted():
    torch.manual_seed(0)
    found = diff.diff(Router(), torch.randn(256, 32), autocast=torch.bfloat16)
    topk = next(o for o in found.ops if o.op == "aten.topk")
    # topk returns values and indices: its values are compared as floats, its indices are not.
    assert topk.local is not None
    gathered = [o for o in found.ops if o.changed]
    assert gathered[0] is topk and 0 < topk.changed < topk.whole == 256 * 8
    assert any("differ from the shadow's" in line for line in found.findings())


def test_a_model_of_torchs_modules_alone_has_no_readers_line():
    # nn.Sequential runs its layers from torch's code: no line of the reader's runs them, and
    # the line that called diff is not one (docs/cli.md once showed its fork helper's line).
    torch.manual_seed(0)
    found = diff.diff(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), torch.randn(2, 8))
    assert {s.line for s in found.sources()} == {"unknown"}
    model, x = net()
    lines = {s.line for s in diff.diff(model, x).sources()}
    assert lines and all(line.startswith("test_diff.py:") for line in lines)
