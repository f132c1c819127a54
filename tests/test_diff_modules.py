"""Module calls split as ops are: local, inherited and total of each call's output."""

import pytest
import torch
from test_diff import InPlace, Net, Rounds, Tied, net
from torch import nn

from mpguide.models import diff, shadow


def by_name(found):
    return {m.label: m for m in found.modules}


@pytest.mark.parametrize("planted", [torch.float16, torch.bfloat16])
def test_the_planted_module_has_the_largest_local_error_of_the_models_children(planted):
    torch.manual_seed(0)
    model, x = Net(planted), torch.randn(4, 16)
    found = diff.diff(model, x, dtype=torch.float32)
    children = [m for m in found.modules if m.depth == 1]
    assert {m.name for m in children} == {"a", "planted", "b"}
    assert max(children, key=lambda m: m.local).name == "planted"
    # The root runs on the model's exact input: its local error is its whole error.
    root = by_name(found)["(root)"]
    assert root.inherited == 0 and root.local == root.output == pytest.approx(found.output.error)


@pytest.mark.parametrize(
    "precision", [{"dtype": torch.float32}, {"autocast": torch.bfloat16}, {"dtype": "bf16"}]
)
def test_local_and_inherited_bound_the_total_for_every_module_call(precision):
    torch.manual_seed(0)
    for model, x in (net(), (Tied(), torch.randint(0, 50, (2, 5)))):
        found = diff.diff(model, x, backward=True, **precision)
        assert all(m.local is not None and not m.why for m in found.modules)
        held, of = found.module_closure
        assert held == of == len(found.modules)
        assert any(f"it held for {of} of {of}" in line for line in found.findings())


class Upcasts(nn.Module):
    """Asks for float32 itself, as a norm or a softmax in a language model does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.softmax(self.lin(x).float() * 3, -1, dtype=torch.float32)


def test_exact_inputs_inherit_nothing_and_the_re_run_finds_the_same(monkeypatch):
    torch.manual_seed(0)
    model, x = Upcasts(), torch.randn(4, 16)
    short = by_name(diff.diff(model, x, dtype=torch.float32))
    # Every input of the root and of lin is exact (the model's input, float32 parameters):
    # their (b) is the shadow's own, so they inherit nothing.
    for m in short.values():
        assert m.inherited == 0 and m.local == m.output > 0
    # The long way, each call re-run in float64: the same to float64's rounding, because the
    # re-run reads the float32 the model asks for as float64, as the shadow does.
    monkeypatch.setattr(shadow.Shadow, "_of", _never_exact(shadow.Shadow._of))
    long = by_name(diff.diff(model, x, dtype=torch.float32))
    for name, m in long.items():
        assert m.inherited < 1e-14 and m.local == pytest.approx(short[name].local, rel=1e-9)


def _never_exact(of):
    def wrapped(self, t):
        found, _ = of(self, t)
        return found, False

    return wrapped


def test_a_cast_models_calls_are_re_run_with_the_exact_parameters():
    # Module a of a model cast whole to bf16: t its bf16 output, b its float64 linear on the
    # rounded input with the parameters before the cast, a the same on the exact input.
    model, x = net()
    found = by_name(diff.diff(model, x, dtype=torch.bfloat16))["a"]
    w, bias = model.a.weight.double(), model.a.bias.double()
    t = model.a.to(torch.bfloat16)(x.bfloat16()).double()
    b = nn.functional.linear(x.bfloat16().double(), w, bias)
    a = nn.functional.linear(x.double(), w, bias)
    norm = a.norm().item()
    assert found.local == pytest.approx((t - b).norm().item() / norm, rel=1e-9)
    assert found.inherited == pytest.approx((b - a).norm().item() / norm, rel=1e-9)
    assert found.output == pytest.approx((t - a).norm().item() / norm, rel=1e-9)


class MutatesInput(nn.Module):
    def forward(self, x):
        return x.mul_(3)


class CachesKeys(nn.Module):
    def __init__(self):
        super().__init__()
        self.keys = torch.zeros(0, 16)

    def forward(self, x):
        self.keys = torch.cat([self.keys, x])
        return self.keys.sum(0)


class Draws(nn.Module):
    def forward(self, x):
        return nn.functional.dropout(x, 0.5, training=True)


class TakesCache(nn.Module):
    def forward(self, x, cache):
        cache.append(x)
        return x * 2


class Cache:
    def __init__(self):
        self.items = []

    def append(self, x):
        self.items.append(x)


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.counts = InPlace()
        self.mutates = MutatesInput()
        self.caches = CachesKeys()
        self.draws = Draws()
        self.takes = TakesCache()

    def forward(self, x, cache):
        h = self.lin(x)
        h = h + self.counts(h[:, :4]).sum()
        h = self.mutates(h * 1.5)
        return self.takes(self.draws(h), cache) + self.caches(h)


def test_calls_that_a_re_run_would_not_repeat_get_no_split_and_say_why():
    torch.manual_seed(0)
    model, cache = Stateful(), Cache()
    found = by_name(diff.diff(model, (torch.randn(4, 16), cache), autocast=torch.bfloat16))
    why = {
        "counts": "changed its inputs or its own state",
        "mutates": "changed its inputs or its own state",
        "caches": "changed its inputs or its own state",
        "draws": "random numbers",
        "takes": "an argument of type Cache",
        "(root)": "random numbers",  # the first reason found: it ran draws
    }
    for name, reason in why.items():
        m = found[name]
        assert m.local is None and m.inherited is None and reason in m.why, (name, m.why)
        assert m.output is not None  # the total is measured all the same
    assert found["lin"].local is not None and found["counts.lin"].local is not None
    # Nothing was run twice on the reader's objects.
    assert len(cache.items) == 1 and int(model.counts.steps) == 1 and len(model.caches.keys) == 4


def test_the_modules_view_ranks_by_local_error_and_fits():
    torch.manual_seed(0)
    found = diff.diff(Net(torch.float16), torch.randn(4, 16), dtype=torch.float32)
    table = found.table("modules")
    assert table.column("module")[:2] == ["(root)", "planted"]
    assert {"local", "inherited", "total"} <= set(table.columns)
    assert all(len(line) <= 100 for line in table.to_text(100).splitlines())


def test_a_model_with_rounds_as_its_only_module_is_split():
    found = diff.diff(Rounds(torch.float16), torch.randn(8), dtype=torch.float32)
    (root,) = found.modules
    assert root.inherited == 0 and root.local == root.output > 0


class Attends(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.dropout = dropout

    def forward(self, q):
        return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=self.dropout)


def test_attention_without_dropout_is_not_random_and_with_it_is():
    # Attention's kernels may draw a dropout mask: asked for none, its result is the shadow's
    # to compute (else the shadow would take the run's values and lose the error before it).
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 16)
    (calm,) = diff.diff(Attends(0.0), q, dtype=torch.bfloat16).modules
    assert calm.local is not None and calm.inherited > 0 and calm.output > 0
    (drawn,) = diff.diff(Attends(0.5), q, dtype=torch.bfloat16).modules
    assert drawn.local is None and "random numbers" in drawn.why


def test_the_error_budget_marks_calls_it_could_not_split():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mpguide.plots import models as model_plots

    torch.manual_seed(0)
    found = diff.diff(Stateful(), (torch.randn(4, 16), Cache()), autocast=torch.bfloat16)
    fig, ax = plt.subplots()
    model_plots.error_budget(found, modules=["lin", "counts", "mutates"], ax=ax)
    (crosses,) = [line for line in ax.lines if line.get_gid() == "not re-run"]
    assert list(crosses.get_xdata()) == [1, 2]
    plt.close(fig)
