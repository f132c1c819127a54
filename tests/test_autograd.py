import pytest
import torch

from mpguide import MPGuideError
from mpguide.training import autograd
from mpguide.training.autograd import DtypeLog, grad_graph

BF16, FP32 = torch.bfloat16, torch.float32
ACC = "torch::autograd::AccumulateGrad"


@pytest.fixture
def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _autocast_step(lin, log=None):
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=BF16):
        y = lin(x)
    loss = y.float().sum()
    if log is None:
        return loss
    with log:
        loss.backward()
    return loss


def test_grad_graph_of_a_plain_linear(linear):
    g = grad_graph(linear(torch.randn(2, 4)).sum(), linear)
    assert [n.name for n in g.nodes()] == [
        "SumBackward0",
        "AddmmBackward0",
        ACC,
        "TBackward0",
        ACC,
    ]
    assert g.param("weight").grad_in[0] == autograd.Meta(FP32, (3, 4), "cpu")
    assert g.param("bias").grad_in[0].shape == (3,)
    assert g.root.grad_in[0].shape == ()


def test_grad_graph_under_autocast_records_bf16_grads_and_fp32_leaves(linear):
    g = grad_graph(_autocast_step(linear), linear)
    assert g.find("AddmmBackward0")[0].grad_in[0].dtype == BF16
    copies = g.find("ToCopyBackward0")
    assert [c.grad_in[0].dtype for c in copies] == [FP32, BF16, BF16]
    assert g.param("weight").grad_in[0].dtype == FP32
    text = repr(g)
    assert "└─ AccumulateGrad  grad in: float32[3, 4] cpu  <- weight" in text
    assert "<pre" in g._repr_html_()
    assert g.table().column("parameter").count("weight") == 1


def test_grad_graph_marks_shared_nodes_once():
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    g = grad_graph(y * y, {"x": x})
    names = [n.name for n in g.nodes()]
    assert names.count("ExpBackward0") == 1
    assert "(shown above)" in repr(g)
    assert g.param("x").name == ACC


def test_grad_graph_renders_a_tree():
    x = torch.randn(3, requires_grad=True)
    g = grad_graph((x.exp() * x.sin()).sum(), {"x": x})
    assert repr(g).splitlines() == [
        "SumBackward0  grad in: float32[] cpu",
        "└─ MulBackward0  grad in: float32[3] cpu",
        "   ├─ ExpBackward0  grad in: float32[3] cpu",
        "   │  └─ AccumulateGrad  grad in: float32[3] cpu  <- x",
        "   └─ SinBackward0  grad in: float32[3] cpu",
        "      └─ AccumulateGrad  grad in: float32[3] cpu  <- x  (shown above)",
    ]
    assert [(d, n.short_name) for d, n in g.walk()][:3] == [
        (0, "SumBackward0"),
        (1, "MulBackward0"),
        (2, "ExpBackward0"),
    ]


def test_grad_graph_of_a_deep_chain_does_not_recurse():
    x = torch.randn(2, requires_grad=True)
    y = x
    for _ in range(3000):
        y = y * 1.0
    g = grad_graph(y.sum(), {"x": x})
    assert len(g.nodes()) == 3002
    assert g.param("x").grad_in[0].shape == (2,)
    assert len(repr(g).splitlines()) == 3002


def test_grad_graph_names_unknown_leaves():
    x = torch.randn(3, requires_grad=True)
    assert "(unnamed leaf)" in repr(grad_graph(x.sin()))


@pytest.mark.parametrize("bad", [torch.randn(3), torch.randn(3, requires_grad=True), 3.0])
def test_grad_graph_rejects_tensors_without_grad_fn(bad):
    with pytest.raises(MPGuideError):
        grad_graph(bad)


def test_dtype_log_catches_the_backward_cast_of_an_fp32_weight(linear):
    log = DtypeLog(linear)
    _autocast_step(linear, log)
    casts = log.select("backward", casts=True)
    by_param = {r.param: r for r in casts if r.param}
    assert by_param["weight"].cast == "bfloat16->float32"
    assert by_param["weight"].node == "ToCopyBackward0"
    assert by_param["weight"].cast_bytes == 12 * (2 + 4)
    assert by_param["bias"].cast_bytes == 3 * (2 + 4)
    assert linear.weight.grad.dtype == FP32
    per_param = log.per_param()
    assert dict(zip(per_param.column("parameter"), per_param.column("bytes"), strict=True)) == {
        "weight": 72,
        "bias": 18,
    }
    assert log.cast_bytes("backward") == sum(r.cast_bytes for r in casts)


def test_dtype_log_phases_and_forward_casts(linear):
    with DtypeLog(linear) as log:
        loss = _autocast_step(linear)
        weight = linear.weight.detach()
        with log.phase("optimizer"):
            weight.mul_(1.0)
        loss.backward()
    assert log.phases() == ["forward", "optimizer", "backward"]
    forward = log.select("forward", casts=True)
    assert {r.cast for r in forward} == {"float32->bfloat16", "bfloat16->float32"}
    assert [r.op for r in log.select("optimizer")] == ["aten.mul_.Tensor"]
    assert log.signatures("aten.mm", "backward") == ["(bfloat16, bfloat16) -> (bfloat16)"]
    assert log.signatures("aten.addmm") == ["(bfloat16, bfloat16, bfloat16) -> (bfloat16)"]


def test_dtype_log_leaves_out_profiler_markers(linear):
    linear(torch.randn(2, 4)).sum().backward()
    with DtypeLog(linear) as log:
        torch.optim.SGD(linear.parameters(), lr=0.1).step()
    assert log.records and all(r.op.startswith("aten.") for r in log.records)


def test_tables_show_short_names(linear):
    log = DtypeLog(linear)
    _autocast_step(linear, log)
    assert "AccumulateGrad" in log.summary().column("autograd node")
    assert "aten.mm" in log.table().column("op")
    assert any(r.node == ACC for r in log.records)


def test_dtype_log_sees_no_cast_without_autocast(linear):
    with DtypeLog(linear) as log:
        linear(torch.randn(2, 4)).sum().backward()
    assert log.select(casts=True) == []
    assert log.cast_bytes() == 0
    assert "0 casts" in repr(log)


def test_copy_between_dtypes_is_a_cast():
    master = torch.randn(5)
    w = torch.zeros(5, dtype=BF16)
    with DtypeLog() as log:
        w.copy_(master)
        w.copy_(w)
    assert [r.cast for r in log.records] == ["float32->bfloat16", ""]
    assert log.records[0].cast_bytes == 5 * 6


def test_dtype_log_tables_render(linear):
    log = DtypeLog(linear)
    _autocast_step(linear, log)
    assert log.casts("backward").column("parameter")[-2:] == ["weight", "bias"]
    assert "bfloat16->float32" in log.table(casts=True).to_markdown()
    assert "<table" in log._repr_html_()
    assert log.summary().notes == (
        "forward: 1 ops, 0 casts, 0 bytes cast",  # the ones_like seed made by backward()
        f"backward: {len(log.select('backward'))} ops, 3 casts, 126 bytes cast",
    )


@pytest.mark.gpu
def test_dtype_log_sees_cuda_backward():
    lin = torch.nn.Linear(8, 8, device="cuda")
    with DtypeLog(lin) as log:
        with torch.autocast("cuda", dtype=torch.float16):
            y = lin(torch.randn(4, 8, device="cuda"))
        y.float().sum().backward()
    weight = [r for r in log.select("backward", casts=True) if r.param == "weight"]
    assert weight[0].cast == "float16->float32"
    assert lin.weight.grad.dtype == FP32
