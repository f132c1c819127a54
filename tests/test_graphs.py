import pytest
import torch
from compile_fns import issue_inputs, matmul_out_fp32, round_trip
from torch.fx.experimental.proxy_tensor import make_fx

from mpguide import MPGuideError
from mpguide.compiled import backends, graphs
from mpguide.core import device, versions


def _exact(x, y, b):
    return torch.matmul(x.double(), y.double()) + b.double()


def _no_low_precision(x):
    return torch.exp(x) * 3.0


def _nodes(gm):
    return {n.name: n for n in gm.graph.nodes}


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_aot_eager_keeps_the_bf16_bmm_and_copies_into_fp32():
    g = graphs.capture(matmul_out_fp32, *issue_inputs(), backend="aot_eager")
    assert g.backward is None
    targets = _targets(g.forward)
    assert "aten.bmm.default" in targets
    assert "prims.convert_element_type.default" not in targets
    nodes = _nodes(g.forward)
    assert nodes["bmm"].meta["val"].dtype == torch.bfloat16
    assert nodes["copy"].meta["val"].dtype == torch.float32
    assert nodes["add"].meta["val"].dtype == torch.float32


@pytest.mark.slow
def test_inductor_graph_is_decomposed_into_fp32_multiply_and_sum():
    g = graphs.capture(matmul_out_fp32, *issue_inputs(), backend="inductor")
    targets = _targets(g.forward)
    assert "aten.bmm.default" not in targets
    assert "aten.mul.Tensor" in targets and "aten.sum.dim_IntList" in targets
    converts = [
        n for n in g.forward.graph.nodes if str(n.target) == "prims.convert_element_type.default"
    ]
    assert [n.meta["val"].dtype for n in converts] == [torch.float32, torch.float32, torch.bfloat16]
    assert _nodes(g.forward)["mul"].meta["val"].dtype == torch.float32
    assert g.code and g.kernels()


def test_render_puts_dtype_and_shape_on_every_node():
    g = graphs.capture(matmul_out_fp32, *issue_inputs(), backend="aot_eager")
    text = g.render()
    assert text.startswith("def forward(arg0_1: bf16[32, 7, 1, 8], ")
    assert "    bmm: bf16[224, 1, 1] = aten.bmm(view, view_1)" in text
    assert "    add: f32[32, 7, 1, 1] = aten.add.Tensor(copy, arg2_1)" in text
    assert "compile_fns.py:" in text and "in matmul_out_fp32: return torch.matmul" in text
    body = [ln for ln in text.splitlines()[1:] if not ln.lstrip().startswith(("#", "return"))]
    assert len(body) == sum(n.op == "call_function" for n in g.forward.graph.nodes)
    assert all(": f32[" in ln or ": bf16[" in ln for ln in body)
    assert "<pre" in g._repr_html_() and repr(g).startswith("# aot_eager, forward")


def test_dtype_flow_on_a_known_graph():
    def f(x, y):
        z = x.to(torch.bfloat16) * 2
        return z.float() + y, torch.relu(x)

    gm = make_fx(f)(torch.ones(4), torch.ones(4, dtype=torch.float64))
    flow = graphs.dtype_flow(gm)
    assert flow.column("op") == ["aten._to_copy", "aten._to_copy", "aten.add.Tensor"]
    assert flow.column("change") == ["conversion", "conversion", "promotion"]
    assert flow.column("in") == ["f32", "bf16", "f32 + f64"]
    assert flow.column("out") == ["bf16", "f32", "f64"]


def test_dtype_flow_names_the_user_line():
    g = graphs.capture(round_trip, torch.ones(8), backend="aot_eager")
    flow = g.flow()
    assert flow.column("out") == ["bf16", "f32"]
    assert all("in round_trip: return x.to(torch.bfloat16)" in s for s in flow.column("user code"))


def test_backward_graph_is_captured_when_an_input_requires_grad():
    w = torch.randn(4, 8, requires_grad=True)
    g = graphs.capture(lambda w: (w.to(torch.bfloat16) * 2).float().sin(), w, backend="aot_eager")
    assert w.grad is None
    assert g.backward is not None
    assert "aten.cos.default" in _targets(g.backward)
    assert g.flow("backward").column("out") == ["f32", "bf16", "f32"]
    assert set(g.graphs()) == {"forward", "backward"}


def test_a_missing_graph_or_unknown_backend_is_a_one_line_error():
    g = graphs.capture(round_trip, torch.ones(8), backend="aot_eager")
    with pytest.raises(MPGuideError, match="no 'backward' graph"):
        g.render("backward")
    with pytest.raises(MPGuideError, match="unknown backend 'eager'"):
        graphs.capture(round_trip, torch.ones(8), backend="eager")


def test_side_by_side_shows_each_capture():
    a = graphs.capture(round_trip, torch.ones(8), backend="aot_eager")
    view = graphs.side_by_side(a, a)
    assert repr(view).count("# aot_eager") == 2
    assert view._repr_html_().count("<pre") == 2


def test_backward_graph_through_a_parameter_under_autocast():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = graphs.capture(lambda x: torch.relu(lin(x)), x, backend="aot_eager")
    assert lin.weight.grad is None and lin.bias.grad is None
    assert g.flow().column("out") == ["bf16"] * 3
    assert g.flow("backward").column("out") == ["f32", "f32"]


def test_eager_flow_records_autocast_casts_forward_and_backward():
    lin = torch.nn.Linear(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        flow = graphs.eager_flow(lambda x: lin(x), torch.randn(4, 16))
    assert flow.column("phase") == ["forward"] * 3 + ["backward"] * 2
    assert flow.column("op") == ["aten._to_copy"] * 5
    assert flow.column("out") == ["bf16"] * 3 + ["f32"] * 2
    assert all("in <lambda>: flow = graphs.eager_flow" in s for s in flow.column("user code")[:3])
    assert lin.weight.grad is None


def test_backward_once_without_grad_does_nothing():
    assert graphs.backward_once(torch.ones(3)) is False
    w = torch.ones(3, requires_grad=True)
    assert graphs.backward_once((w * 2).sum()) is True
    assert w.grad is None


def test_compact_render_keeps_dtype_shape_and_op():
    g = graphs.capture(matmul_out_fp32, *issue_inputs(), backend="aot_eager")
    lines = g.render(compact=True).splitlines()
    assert lines[:2] == ["def forward(", "    arg0_1: bf16[32, 7, 1, 8],"]
    assert "    bf16[224, 1, 1]    bmm" in lines
    assert not any(ln.lstrip().startswith("#") for ln in lines)
    assert "bmm" in repr(graphs.side_by_side(g))


# -- simulated devices -----------------------------------------------------------------------


def _simulated(dev_type, fn, specs, backend, requires_grad=False, autocast=None):
    target = device.target(dev_type, simulate=True)
    with device.tensors(target), device.autocast(target, autocast):
        return graphs.capture(
            fn, *graphs.inputs(specs, target.device, requires_grad), backend=backend
        )


_ISSUE_SPECS = ("bf16[32,7,1,8]", "bf16[32,7,8,1]", "bf16[32,7,1,1]")


@pytest.mark.slow
def test_simulated_cuda_inductor_keeps_the_bmm_that_cpu_decomposes():
    cpu = _simulated("cpu", matmul_out_fp32, _ISSUE_SPECS, "inductor")
    cuda = _simulated("cuda", matmul_out_fp32, _ISSUE_SPECS, "inductor")
    assert ("aten.bmm", "bf16[224, 1, 1]") in cuda.nodes()
    assert "aten.bmm" not in [op for op, _ in cpu.nodes()]
    assert ("aten.mul.Tensor", "f32[224, 8]") in cpu.nodes()
    assert ("aten.sum.dim_IntList", "f32[224, 1]") in cpu.nodes()
    for g, dev in ((cpu, "cpu"), (cuda, "cuda")):
        assert g.device == dev and g.simulated and g.how == device.SIMULATED
        assert g.note == graphs.SIMULATED_INDUCTOR and g.kernels() == () and g.code == ()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    ("fn", "specs", "grad"),
    [
        (matmul_out_fp32, _ISSUE_SPECS, False),
        (round_trip, ("f32[64]",), True),
        (
            lambda x, w: (
                (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True))).to(x.dtype) * w
            ),
            ("bf16[16,64]", "bf16[64]"),
            True,
        ),
    ],
    ids=["matmul_out", "round_trip", "rmsnorm"],
)
def test_simulated_cpu_capture_equals_the_live_one_node_for_node(fn, specs, grad, backend):
    live = graphs.capture(fn, *graphs.inputs(specs, "cpu", grad), backend=backend)
    sim = _simulated("cpu", fn, specs, backend, requires_grad=grad)
    assert not live.simulated and sim.simulated
    assert (
        set(live.graphs())
        == set(sim.graphs())
        == ({"forward", "backward"} if grad else {"forward"})
    )
    # Before 2.13 inductor's pointless_convert, a pattern pass a simulation skips, replaces the
    # round trip's two conversions by one to float32: the simulation keeps the bf16 one.
    skipped = (
        fn is round_trip
        and backend == "inductor"
        and not versions.change("inductor_cpu_bf16_round_trip").holds
    )
    for which in live.graphs():
        sim_nodes = [
            n
            for n in sim.nodes(which)
            if not (skipped and n == ("prims.convert_element_type", "bf16[64]"))
        ]
        assert sim_nodes == live.nodes(which)
    assert (len(sim.nodes()) > len(live.nodes())) is skipped


def test_simulated_cuda_under_autocast_runs_softmax_in_fp32_and_has_no_backward():
    target = device.target("cuda", simulate=True)
    with device.tensors(target), device.autocast(target, torch.bfloat16):
        lin = torch.nn.Linear(32, 16, device=target.device)
        g = graphs.capture(lambda x: torch.softmax(lin(x), -1), torch.randn(8, 32, device="cuda"))
    assert ("aten._softmax", "f32[8, 16]") in g.nodes()
    assert ("aten.addmm", "bf16[8, 16]") in g.nodes()
    assert g.backward is None and "no backward graph" in g.note
    assert device.simulates_autograd("cuda") is torch.cuda.is_available()
    assert "cannot run autograd on a simulated cuda" in g.note


def test_provenance_is_in_every_rendering():
    sim = _simulated("cuda", round_trip, ("f32[8]",), "aot_eager")
    live = graphs.capture(round_trip, torch.ones(8), backend="aot_eager")
    for g, how in ((sim, device.SIMULATED), (live, device.LIVE)):
        assert how in repr(g) and how in g._repr_html_() and how in g.flow().caption
        view = graphs.side_by_side(g)
        assert how in repr(view) and how in view._repr_html_()
    assert sim.label == "aot_eager, cuda (simulated)"
    assert live.label == f"aot_eager, cpu ({device.LIVE})"


def test_simulated_capture_refuses_emulation_and_mixed_fake_modes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(MPGuideError, match="changes only the code inductor generates"):
        _simulated("cpu", round_trip, ("f32[8]",), backends.EMULATE)
    with FakeTensorMode():
        a = torch.ones(2)
    with FakeTensorMode():
        b = torch.ones(2)
    with pytest.raises(MPGuideError, match="different fake modes"):
        graphs.capture(torch.add, a, b)


def _raises_inside(x):
    if (x * 2).shape[0] == 4:
        raise ValueError("the reader's bug")
    return x


def test_simulated_capture_restores_state_when_the_function_raises():
    target = device.target("cuda", simulate=True)
    copy_, before = torch.Tensor.copy_, torch.get_autocast_dtype("cuda")
    with (
        pytest.raises(Exception, match="the reader's bug"),
        device.tensors(target),
        device.autocast(target, torch.float16),
    ):
        graphs.capture(_raises_inside, torch.ones(4, device="cuda"))
    assert torch.Tensor.copy_ is copy_
    assert not torch.is_autocast_enabled("cuda")
    assert torch.get_autocast_dtype("cuda") == before
    assert torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
    assert torch._guards.TracingContext.try_get() is None
    seen = []

    def count(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    assert torch.compile(lambda x: x.sin(), backend=count)(torch.zeros(1)).item() == 0.0
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("bf16(3)", r"bad input 'bf16\(3\)'"),
        ("q8[3]", r"bad input 'q8\[3\]'"),
        ("f32", "bad input"),
    ],
)
def test_inputs_refuse_a_bad_spec(spec, message):
    with pytest.raises(MPGuideError, match=message):
        graphs.inputs([spec], "cpu")


def test_inputs_read_the_graph_notation():
    x, i, s = graphs.inputs(["bf16[2, 3]", "i64[4]", "f32[]"], "cpu", requires_grad=True)
    assert (x.dtype, x.shape, x.requires_grad) == (torch.bfloat16, (2, 3), True)
    assert (i.dtype, i.shape, i.requires_grad) == (torch.int64, (4,), False)
    assert s.shape == ()


@pytest.mark.slow
def test_simulated_inductor_lacks_the_pattern_passes_but_not_a_dtype_change():
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(32, 16), torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        live = graphs.capture(lambda x: torch.softmax(lin(x), -1), x, backend="inductor")
    target = device.target("cpu", simulate=True)
    with device.tensors(target), device.autocast(target, torch.bfloat16):
        fake_lin = torch.nn.Linear(32, 16)
        sim = graphs.capture(
            lambda x: torch.softmax(fake_lin(x), -1), torch.randn(8, 32), backend="inductor"
        )
    assert sim.nodes() == live.nodes()
    # A pattern pass folds the backward's permute of a permute; simulation keeps both views.
    extra = [n for n in sim.nodes("backward") if n not in live.nodes("backward")]
    assert extra == [("aten.permute", "bf16[32, 16]"), ("aten.permute", "bf16[16, 32]")]
    flows = [
        [(r["op"], r["in"], r["out"]) for r in g.flow("backward").records()] for g in (sim, live)
    ]
    assert flows[0] == flows[1] and flows[0]


# -- real modules --------------------------------------------------------------------------------

torch.manual_seed(0)
_REAL = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
_REAL.register_buffer("scale", torch.ones(4))


def _reaches_a_real_module(ids):
    out = _REAL(ids)[:, -1, None] * _REAL.scale
    return out + torch.tensor([], device=ids.device).sum()  # a constant moved to the device


def test_modules_of_finds_the_modules_a_function_reaches():
    inner = torch.nn.Linear(2, 2)

    def closure(x):
        return inner(x)

    assert _REAL in graphs.modules_of(_reaches_a_real_module)
    assert inner in graphs.modules_of(closure)
    assert graphs.modules_of(inner.forward)[0] is inner
    assert graphs.modules_of(inner) == [inner]


@pytest.mark.parametrize("dev_type", ["cpu", "cuda"])
def test_a_function_reaching_a_real_module_is_traced_on_a_simulated_device(dev_type):
    target = device.target(dev_type, simulate=True)
    weight = _REAL[2].weight
    with device.tensors(target, graphs.modules_of(_reaches_a_real_module)):
        (ids,) = graphs.inputs(["i64[2,5]"], target.device)
        with device.autocast(target, torch.bfloat16):
            g = graphs.capture(_reaches_a_real_module, ids)
    assert g.simulated and g.device == dev_type
    nodes = g.nodes()
    assert ("aten.addmm", "bf16[10, 4]") in nodes and ("aten.unsqueeze", "bf16[2, 1, 4]") in nodes
    assert ("aten.add.Tensor", "f32[2, 1, 4]") in nodes
    assert ("backward" in g.graphs()) is device.simulates_autograd(dev_type)
    assert _REAL[2].weight is weight and not isinstance(weight, torch._subclasses.FakeTensor)
