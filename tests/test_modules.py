import io

import pytest
import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.compiled import graphs
from mpguide.core import device
from mpguide.models import per_module
from mpguide.precision import numerics
from mpguide.training import autograd


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class Cancel(nn.Module):
    """``(x + 1000) - 1000``: exact in float64, a coarse rounding of ``x`` in fp16."""

    def forward(self, x):
        return (x + 1000) - 1000


class OwnCast(nn.Module):
    """Casts to float16 itself, with or without autocast, then back to float32."""

    def forward(self, x):
        return x.to(torch.float16).float()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)), torch.randn(4, 16)


def test_a_linear_under_autocast_against_its_own_float64_run():
    model, x = _mlp()
    report = per_module.report(model, x, autocast="bf16", device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = model[0](x)
    want = numerics.errors(first, nn.Linear.forward(model[0].double(), x.double()))
    model.float()
    row = report["0"]
    assert (row.kind, row.inputs, row.outputs, row.params) == (
        "Linear",
        (torch.float32,),
        (torch.bfloat16,),
        (torch.float32,),
    )
    assert row.error == want and row.input_error.max_abs == 0
    # Autocast casts the input, the weight and the bias to bf16; a plain run casts nothing.
    assert row.casts == row.autocast_casts == 3
    assert report["1"].ops == 1 and report["1"].casts == 0
    assert [c.label for c in report.calls] == ["(root)", "0", "1", "2"]
    assert report.how == device.LIVE and not report.simulated
    assert report[""].depth == 0 and report["2"].depth == 1


def test_a_module_called_twice_has_a_row_per_call():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    report = per_module.report(model, torch.randn(2, 8))
    assert [c.key for c in report.calls] == [("", 0), ("0", 0), ("1", 0), ("0", 1)]
    assert report[("0", 1)].label == "0, call 2"
    # The second call's input carries the error of the first call and the tanh.
    assert report[("0", 1)].input_error == report["1"].error
    assert report[("0", 1)].error != report["0"].error


def test_autocast_casts_leave_out_the_casts_the_module_makes_itself():
    model = nn.Sequential(nn.Linear(4, 4), OwnCast())
    report = per_module.report(model, torch.randn(2, 4), autocast=torch.float16)
    # Under autocast the linear returns fp16, so only the cast back to fp32 runs; without
    # autocast both casts run: autocast added none of them.
    assert report["1"].casts == 1 and report["1"].autocast_casts == 0
    assert report["0"].autocast_casts == 3
    # The float64 reference also rounds to fp16 inside OwnCast, and the report says so.
    assert report.narrowed == (("1", 0),)
    assert any("narrower dtype in 1 module calls (1)" in f for f in report.findings())


def test_an_fp16_overflow_is_found_where_it_starts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Scale(1e5), nn.Linear(8, 8), nn.Softmax(-1))
    x = torch.randn(4, 8)
    fp16 = per_module.report(model, x, autocast="float16")
    scale = fp16["1"]
    ref = model[0](x).double() * 1e5
    over = int((ref.abs() > torch.finfo(torch.float16).max).sum())
    assert over > 0 and scale.beyond_range == over and scale.inf == over and scale.nan == 0
    assert fp16["0"].nonfinite == 0
    assert fp16["2"].input_nonfinite == over and fp16["2"].nonfinite > 0
    assert fp16.first_nonfinite is scale
    assert fp16.findings()[0].startswith("first non-finite output: 1 (Scale)")
    bf16 = per_module.report(model, x, autocast="bfloat16")
    assert bf16.first_nonfinite is None and bf16["1"].beyond_range == 0
    assert all(c.nonfinite == 0 for c in bf16.calls)


def test_values_flushed_to_zero_and_a_jump_in_error():
    torch.manual_seed(0)
    x = torch.rand(4, 8) + 0.5
    model = nn.Sequential(Scale(1.0), Scale(1e-9), Scale(1e9), Cancel())
    report = per_module.report(model, x, dtype="float16")
    assert report.dtype == torch.float16 and report.autocast is None
    assert report["1"].to_zero == x.numel() and report["0"].to_zero == 0
    # Scaling back up cannot recover the values: the error is the whole reference.
    assert report["2"].error.max_abs == pytest.approx(x.abs().max().item(), rel=1e-9)
    assert report.largest_jump is report["1"]
    cancel = per_module.report(nn.Sequential(Scale(1.0), Cancel()), x, dtype="float16")
    assert cancel.largest_jump is cancel["1"] and cancel["1"].to_zero == 0
    assert cancel["1"].error.max_rel > per_module.JUMP * cancel["1"].input_error.max_rel
    columns = report.table(columns="all").columns
    assert "autocast casts" not in columns and per_module.BEYOND in columns
    assert set(report.table().columns) < set(columns)


def test_backward_ops_and_casts_fall_in_the_module_that_ran_the_forward_op():
    model, x = _mlp()
    report = per_module.report(model, x, backward=True)
    with autograd.DtypeLog() as log:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        graphs.backward_once(out)  # as the report does: no .grad is written
    backward = log.select(autograd.BACKWARD)
    assert sum(c.backward_ops for c in report.calls) == len(backward)
    assert sum(c.backward_casts for c in report.calls) == len([r for r in backward if r.is_cast])
    relu = [r.op_name for r in backward if r.node_name == "ReluBackward0"]
    assert report["1"].backward_ops == len(relu) and "aten.threshold_backward" in relu
    assert report["0"].backward_casts == report["0"].backward_autocast_casts == 2
    assert all(p.grad is None for p in model.parameters())


def test_a_simulated_device_has_dtypes_and_casts_but_no_errors():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    x = torch.randn(2, 8)
    cuda = per_module.report(model, x, autocast="fp16", device="cuda", simulate=True)
    cpu = per_module.report(model, x, autocast="fp16", device="cpu")
    assert cuda.simulated and cuda.how == device.SIMULATED and device.SIMULATED in cuda.caption
    # Each device's autocast: CUDA runs layer_norm in fp32, the CPU keeps fp16.
    assert cuda["1"].outputs == (torch.float32,) and cpu["1"].outputs == (torch.float16,)
    assert cuda["1"].error is None and cuda.first_nonfinite is None
    assert "out err" not in cuda.table().columns and "out err" in cpu.table().columns
    assert cuda.findings() == [
        f"simulated ({device.SIMULATED}): dtypes, ops and casts only, no errors"
    ]
    assert not any(isinstance(p, torch._subclasses.FakeTensor) for p in model.parameters())
    differ = per_module.differences(cpu, cuda)
    assert [r[0] for r in differ.rows] == ["(root)", "1"]
    assert differ.records()[1]["out, cuda (simulated) autocast(cuda, float16)"] == "f32"
    assert differ.records()[1][f"out, cpu ({device.LIVE}) autocast(cpu, float16)"] == "f16"


def test_differences_lists_a_call_only_one_report_has():
    torch.manual_seed(0)
    one, two = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    table = per_module.differences(per_module.report(one, x), per_module.report(two, x))
    assert [r[0] for r in table.rows] == ["1"] and table.rows[0][1:5] == (None,) * 4
    assert table.columns[1].endswith("(1)") and table.columns[5].endswith("(2)")


def test_the_model_is_left_as_it_was_even_when_it_raises():
    model, x = _mlp()
    model.train()
    model[1].eval()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    objects = list(model.parameters())
    per_module.report(model, x, dtype="bf16", backward=True)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        per_module.report(model, x[:, :3])
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert list(model.parameters()) == objects and all(p.dtype == torch.float32 for p in objects)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not torch.is_autocast_enabled("cpu")
    assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None


def test_limit_keeps_the_first_rows_and_says_how_many_more():
    model, x = _mlp()
    table = per_module.report(model, x).table(limit=2)
    assert [r[0] for r in table.rows] == ["(root)", "0"]
    assert table.notes[-1] == "... 2 more module calls not shown (2 of 4)"
    assert (
        "(root)" in repr(per_module.report(model, x))
        and "<table" in per_module.report(model, x)._repr_html_()
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": 3}, "must be a torch.nn.Module"),
        ({"autocast": "bf16", "dtype": "fp16"}, "not both"),
        ({"autocast": "float32"}, "autocast takes bfloat16 or float16"),
        ({"dtype": "float64"}, "float64 already"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
        ({"inputs": "text"}, "inputs must be a tensor"),
        ({"inputs": (1, 2)}, "the inputs hold no tensor"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, message):
    model, x = _mlp()
    args = {"model": model, "inputs": x, **kwargs}
    with pytest.raises(MPGuideError, match=message):
        per_module.report(args.pop("model"), args.pop("inputs"), **args)


class LowOnly(nn.Module):
    def forward(self, x):
        if x.dtype == torch.float64:
            raise TypeError("no float64 kernel")
        return x * 2


def test_a_model_that_cannot_run_in_float64_is_named_so():
    with pytest.raises(MPGuideError, match="the float64 copy of the model raised TypeError"):
        per_module.report(LowOnly(), torch.ones(2))


@pytest.mark.skipif(device.simulates_autograd("cuda"), reason="autograd runs on CUDA here")
def test_backward_on_a_device_this_build_cannot_differentiate_is_refused():
    model, x = _mlp()
    with pytest.raises(MPGuideError, match=r"no backward pass: .* on a simulated cuda"):
        per_module.report(model, x, device="cuda", simulate=True, backward=True)


# -- a model from a library readers use ------------------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("transformers")
    from mpguide.models import zoo

    model = zoo.qwen2(vocab=64, hidden=32, intermediate=64)
    return model, zoo.token_inputs(model, 2, 8)


@pytest.mark.slow
def test_a_transformers_model_live_and_simulated(qwen):
    model, inputs = qwen
    live = per_module.report(model, inputs, backward=True)
    q, norm = live["model.layers.0.self_attn.q_proj"], live["model.layers.0.input_layernorm"]
    assert q.outputs == (torch.bfloat16,) and q.params == (torch.float32,) and q.autocast_casts
    # Qwen2's RMSNorm computes in float32 itself: its output stays float32 under autocast,
    # and in the float64 reference it rounds to float32 (the report says where).
    assert norm.outputs == (torch.float32,) and norm.key in live.narrowed
    assert live[""].error.max_rel > 0 and live.first_nonfinite is None
    assert sum(c.backward_ops for c in live.calls) > sum(c.ops for c in live.calls)
    sim = per_module.report(model, inputs, autocast="fp16", device="cuda", simulate=True)
    assert [c.key for c in sim.calls] == [c.key for c in live.calls]
    assert sim["model.layers.1.mlp.down_proj"].outputs == (torch.float16,)


class Shift(nn.Module):
    def forward(self, x):
        return x - 1.0


def test_only_values_the_format_flushed_count_as_to_zero():
    """1 + 2**-10 is 1 in bf16: x - 1 and its ReLU are 0 where the reference is 2**-10, far
    above bf16's smallest normal: rounding error, not a flush."""
    x = torch.full((4, 8), 1 + 2**-10)
    report = per_module.report(nn.Sequential(Shift(), nn.ReLU()), x, dtype="bfloat16")
    assert report["0"].error.max_rel == 1.0 and report["1"].error.max_rel == 1.0
    assert report["0"].to_zero == 0 and report["1"].to_zero == 0


def test_progress_says_the_first_message_then_at_most_one_each_interval():
    from mpguide.models import progress

    out, now = io.StringIO(), [0.0]
    say = progress.Progress(out, every=0.25, clock=lambda: now[0])
    for t, text in [(0.0, "a"), (0.1, "b"), (0.3, "c"), (0.5, "d"), (0.56, "e")]:
        now[0] = t
        say(text)
    assert out.getvalue() == "mpguide: a\nmpguide: c\nmpguide: e\n"
    assert progress.to_terminal(io.StringIO()) is None  # not a terminal, not forced


def test_memory_needed_counts_each_copy_the_report_keeps(monkeypatch):
    from mpguide.models import memory

    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20))
    # Parameters 10*20 + 20 + 2*20 = 260; buffers 2*20 floats and one int64 count.
    needs = memory.report_needs(model, torch.float16, copied=True, backward=True)
    assert needs == {"float64 copy": 300 * 8 + 8, "cast copy": 300 * 2 + 8, "gradients": 260 * 2}
    assert memory.report_needs(model, None, copied=False, backward=False) == {"float64 copy": 2408}
    with open("/proc/meminfo") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
    have, where = memory.available(torch.device("cpu"))
    assert where == "MemAvailable" and abs(have - kb * 1024) < 2**28  # it moves meanwhile
    monkeypatch.setenv(memory.ENV, "2.5")
    assert memory.available(torch.device("cpu")) == (2_500_000_000, memory.ENV)
    monkeypatch.setenv(memory.ENV, "lots")
    with pytest.raises(MPGuideError, match="MPGUIDE_MEMORY_GB must be a number of GB"):
        memory.available(torch.device("cpu"))


def test_a_cast_is_any_change_of_dtype_in_model_as_in_casts():
    from mpguide.core import cast_rule

    class Positions(nn.Module):
        def forward(self, x):
            pos = torch.arange(x.shape[-1]).to(torch.float32)  # int64 -> float32: a cast
            return x.to(torch.float32) + pos  # float32 -> float32: no cast

    r = per_module.report(Positions(), torch.randn(2, 4), dtype=torch.float32, device="cpu")
    assert r[""].casts == 1
    assert cast_rule.is_cast(torch.int64, "float32") and cast_rule.is_cast("bool", torch.float32)
    assert not cast_rule.is_cast(torch.bfloat16, "bfloat16")
