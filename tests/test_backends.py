import pytest
import torch
from compile_fns import issue_inputs, matmul_out_fp32, round_trip

from mpguide import MPGuideError
from mpguide.compiled import backends


def _exact(x, y, b):
    return torch.matmul(x.double(), y.double()) + b.double()


def _no_low_precision(x):
    return torch.exp(x) * 3.0


def test_an_unknown_backend_is_a_one_line_error():
    with pytest.raises(MPGuideError, match="unknown backend 'cudagraphs'"):
        backends.compare(round_trip, (torch.ones(8),), backends=("cudagraphs",))


def test_errors_are_those_of_numerics_over_all_outputs():
    x = torch.tensor([1.0, -2.0, 4.0])
    c = backends.compare(
        lambda x: (x * 1.5, x),
        (x,),
        backends=("eager",),
        reference=lambda x: (x.double() * 1.5 + 0.5, x.double()),
    )
    # |error| is 0.5 in the first output's three values and 0 in the second's; the reference's
    # six absolute values 2, 2.5, 6.5, 1, 2, 4 have mean 3.
    assert c["eager"].max_abs == 0.5
    assert c["eager"].max_rel == 0.5 / 3.0


def test_no_low_precision_step_agrees_with_the_reference_to_fp32_accuracy():
    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    c = backends.compare(_no_low_precision, (x,), backends=("eager", "aot_eager"))
    eps = torch.finfo(torch.float32).eps
    for o in c.outcomes:
        assert o.error is None and o.dtype == "float32"
        assert o.max_rel < 4 * eps
    assert c["aot_eager"].equals_eager is True


def test_a_forced_bf16_round_trip_shows_bf16_sized_error():
    x = torch.randn(256, generator=torch.Generator().manual_seed(1))
    c = backends.compare(
        round_trip, (x,), backends=("eager", "aot_eager"), reference=lambda x: x.double() * 3.0
    )
    # one bf16 rounding: each error is at most bf16's unit roundoff times that value
    largest = 3.0 * x.double().abs().max().item()
    unit_roundoff = torch.finfo(torch.bfloat16).eps / 2
    for o in c.outcomes:
        assert 100 * torch.finfo(torch.float32).eps * largest < o.max_abs
        assert o.max_abs <= unit_roundoff * largest
    assert c["aot_eager"].equals_eager is True


def test_a_backend_that_raises_gets_a_row_with_its_error():
    c = backends.compare(
        matmul_out_fp32, issue_inputs(), backends=("eager", "aot_eager"), reference=_exact
    )
    eager, aot = c["eager"], c["aot_eager"]
    assert eager.error.startswith("RuntimeError: Expected out tensor to have dtype")
    assert eager.max_abs is None and eager.dtype == ""
    assert aot.error is None and aot.dtype == "float32" and aot.equals_eager is None
    assert aot.max_abs > 0
    rows = c.table().records()
    assert rows[0]["error"] == eager.error and rows[1]["error"] is None
    assert "<table" in c._repr_html_() and c.reference == "_exact"


def test_reference_dtype_casts_the_inputs():
    x = torch.randn(16, generator=torch.Generator().manual_seed(2))
    c = backends.compare(lambda x: x * 3.0, (x,), backends=("eager",))
    assert c.reference == "float64 eager"
    assert c["eager"].max_rel < torch.finfo(torch.float32).eps


def test_a_reference_that_raises_is_a_one_line_error():
    with pytest.raises(MPGuideError, match=r"the reference \(float64 eager\) raised RuntimeError"):
        backends.compare(matmul_out_fp32, issue_inputs(), backends=("eager",))
