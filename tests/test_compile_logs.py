import pytest
import torch
from compile_fns import round_trip

from mpguide import MPGuideError
from mpguide.compiled import backends, compile_logs, graphs
from mpguide.core import versions

# Slow: inductor compiles (nox -s tests -- -m 'not slow' leaves it out).
pytestmark = pytest.mark.slow


def test_unused_conversions_finds_a_dropped_rounding():
    kernel = """
        auto tmp0 = load(in_ptr0);
        auto tmp1 = at::vec::convert<at::BFloat16,1,float,2>(tmp0);
        auto tmp2 = tmp0 * tmp3;
        tmp2.store(out_ptr0);
    """
    assert compile_logs.unused_conversions(kernel) == [
        "auto tmp1 = at::vec::convert<at::BFloat16,1,float,2>(tmp0);"
    ]
    triton = (
        "    tmp1 = tmp0.to(tl.bfloat16)\n    tmp2 = tmp1.to(tl.float32)\n    tl.store(p, tmp2)"
    )
    assert compile_logs.unused_conversions(triton) == []


def test_inductor_drops_a_bf16_round_trip_on_cpu_unless_emulating():
    x = torch.randn(64)
    plain = graphs.capture(round_trip, x, backend="inductor")
    emulated = graphs.capture(round_trip, x, backend=backends.EMULATE)
    kept = versions.change("inductor_cpu_bf16_round_trip").holds
    # Before 2.13 the round trip is gone from the graph: no kernel converts to bf16 at all.
    assert (
        ("prims.convert_element_type", "bf16[64]") in plain.nodes()
        if kept
        else not any(t.startswith("bf16") for _, t in plain.nodes())
    )
    assert len(compile_logs.unused_conversions(plain.kernels()[0])) == (1 if kept else 0)
    assert compile_logs.unused_conversions(emulated.kernels()[0]) == []
    assert ("BFloat16" in emulated.kernels()[0]) is kept


def test_torch_logs_returns_each_artifact():
    script = (
        "import torch\n"
        "f = torch.compile(lambda x: x.to(torch.bfloat16) * 2, backend='aot_eager')\n"
        "f(torch.ones(4))\n"
    )
    logs = compile_logs.torch_logs(script, ["graph_code", "aot_graphs"])
    assert "TRACED GRAPH" in logs["graph_code"]
    assert "===== Forward graph 0 =====" in logs["aot_graphs"]
    assert "bf16[4]" in logs["aot_graphs"] and "[__" not in logs["aot_graphs"]


def test_torch_logs_names_a_failing_script():
    with pytest.raises(MPGuideError, match="exited with status 1: ZeroDivisionError"):
        compile_logs.torch_logs("1 / 0", ["graph_code"])
