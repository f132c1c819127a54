import json
from collections import Counter
from pathlib import Path

import pytest

from mpguide import MPGuideError
from mpguide.traces import casts, trace, tracegen

DATA = Path(__file__).parent / "data"
BASE = 4_402_438_546_149.513


def op(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def report_of(*events):
    doc = json.dumps({"traceEvents": list(events)}).encode()
    return casts.report(trace.parse(doc).tree())


def to_chain(ts, shape, src, dst, code, dur=10.0, concrete=True):
    to_args = {
        "Input type": [src, "Scalar", "Scalar", "Scalar", ""],
        "Input Dims": [shape, [], [], [], []],
    }
    if concrete:
        to_args["Concrete Inputs"] = ["", code, "False", "False", ""]
    return [
        op("aten::to", ts, dur, **to_args),
        op("aten::_to_copy", ts + 1, dur - 2, **{"Input type": [src], "Input Dims": [shape]}),
        op(
            "aten::copy_",
            ts + 2,
            dur - 4,
            **{"Input type": [dst, src, "Scalar"], "Input Dims": [shape, shape, []]},
        ),
    ]


def test_real_autocast_matmul_casts():
    report = casts.report(trace.load(DATA / "autocast_matmul.json.gz").tree())
    by_cause = {c.cause: c for c in report}
    down = by_cause["aten::matmul"]
    assert (down.source, down.target, down.direction) == ("float32", "bfloat16", "down-cast")
    assert down.shape == (32, 16)
    assert (down.bytes_read, down.bytes_written) == (32 * 16 * 4, 32 * 16 * 2)
    assert down.op == "aten::to" and not down.backward
    up = [c for c in report if c.source == "bfloat16" and c.target == "float32"]
    assert len(up) == 1 and up[0].shape == (64, 16) and up[0].direction == "up-cast"
    assert 0 < down.share < 1


def test_real_train_step_ties_backward_casts_to_their_forward_cast():
    tree = trace.load(DATA / "train_step.json.gz").tree()
    report = casts.report(tree)
    backward = [c for c in report if c.backward]
    assert backward and all(c.pass_ == "backward" for c in backward)
    by_id = {c.id: c for c in report}
    tied = [c for c in backward if c.forward_id is not None]
    # Every cast under a ToCopyBackward0 node, and only those, is tied: read from the tree.
    under_to_copy = {
        c.id
        for c in backward
        if any(a.name.endswith(": ToCopyBackward0") for a in tree.node(c.id).ancestors())
    }
    assert {c.id for c in tied} == under_to_copy and len(tied) == 5
    for c in tied:
        f = by_id[c.forward_id]
        assert not f.backward and (f.source, f.target) == (c.target, c.source)
        assert f.shape == c.shape and c.cause == f.cause and c.module == f.module
        node = next(a for a in tree.node(c.id).ancestors() if a.name.endswith("Backward0"))
        assert node.field("Sequence number") == tree.node(f.id).field("Sequence number")
    assert sum(c.cause == "aten::linear" for c in tied) == 4
    forward_linear = [c for c in report if c.cause == "aten::linear" and not c.backward]
    assert forward_linear and all(c.target == "bfloat16" for c in forward_linear)


def test_one_row_per_chain_with_its_cause():
    events = [
        op("aten::layer_norm", BASE, 100.0),
        *to_chain(BASE + 5, [8, 4], "c10::BFloat16", "float", "6"),
        op("aten::native_layer_norm", BASE + 20, 50.0),
    ]
    report = report_of(*events)
    (cast,) = report.casts
    assert (cast.cause, cast.source, cast.target) == ("aten::layer_norm", "bfloat16", "float32")
    assert (cast.bytes_read, cast.bytes_written) == (64, 128)
    row = report.summary("cause").records()[0]
    assert row["cpu us"] == 10.0 and row["cause cpu us"] == 90.0


def test_same_dtype_copies_are_not_casts():
    assert len(report_of(*to_chain(BASE, [4], "float", "float", "6"))) == 0


def test_target_from_copy_when_concrete_inputs_are_missing():
    (cast,) = report_of(*to_chain(BASE, [4], "float", "c10::Half", "5", concrete=False))
    assert (cast.source, cast.target) == ("float32", "float16")


def test_a_bare_copy_is_a_cast_and_python_frames_are_not_causes():
    report = report_of(
        op("aten::mul", BASE, 50.0),
        op("train.py(4): step", BASE + 1, 40.0, "python_function"),
        op("aten::copy_", BASE + 2, 5.0, **{"Input type": ["float", "double"]}),
    )
    (cast,) = report.casts
    assert (cast.cause, cast.source, cast.target) == ("aten::mul", "float64", "float32")
    assert cast.shape is None and cast.bytes_read is None


def test_compiled_convert_kernels_are_fused_casts_apart_from_the_aten_casts():
    report = report_of(op("aten::add", BASE, 20.0), op("cpp_fused__to_copy_add_0", BASE + 1, 5.0))
    assert len(report) == 0 and len(report.fused) == 1
    (row,) = report.fused.table().records()
    assert row == {
        "kernel": "cpp_fused__to_copy_add_0",
        "kind": "compiled",
        "cause": "aten::add",
        "pass": "forward",
        "device": "cpu",
        "kernels": 1,
        "kernel us": 5.0,
    }
    assert "1 casts fused into kernels (5.0 µs of kernel time)" in report.summary().notes[-1]


def test_fp8_scalar_type_codes():
    (cast,) = report_of(*to_chain(BASE, [16], "c10::BFloat16", "c10::Float8_e4m3fn", "24"))
    assert cast.target == "float8_e4m3fn" and cast.bytes_written == 16


def test_gpu_time_and_summaries_on_a_generated_gpu_trace():
    events = list(tracegen.generate(200, gpu=True, layers_per_step=1))
    doc = json.dumps({"traceEvents": [tracegen._json(e) for e in events]}).encode()
    tree = trace.parse(doc).tree()
    report = casts.report(tree)
    assert len(report) > 0
    for c in report:
        kernels = [n for n in tree.node(c.id).walk() if n.is_gpu]
        assert kernels and c.gpu_us == pytest.approx(sum(k.dur for k in kernels))
    assert "gpu us" in report.table().columns
    causes = {r["cause"] for r in report.summary("cause").records()}
    assert causes == {"aten::linear", "aten::layer_norm"}
    pairs = report.summary("pair").records()
    assert sum(r["casts"] for r in pairs) == len(report)
    directions = {r["direction"] for r in report.summary("direction").records()}
    assert directions == {"down-cast", "up-cast"}
    assert report.summary("pass").records()[0]["pass"] == "forward"
    with pytest.raises(ValueError, match="unknown summary 'dtype'"):
        report.summary("dtype")


def _by_hand(report, by):
    """The summary computed from the casts one by one."""
    key = {
        "cause": lambda c: (c.cause,),
        "pair": lambda c: (c.source, c.target),
        "direction": lambda c: (c.direction,),
        "pass": lambda c: (c.pass_,),
    }[by]
    groups = {}
    for c in report:
        groups.setdefault(key(c), []).append(c)
    return {
        k: (len(cs), sum(c.bytes_written or 0 for c in cs), sum(c.cpu_us for c in cs))
        for k, cs in groups.items()
    }


@pytest.mark.parametrize("by", ["cause", "pair", "direction", "pass"])
def test_summaries_add_up_the_casts(by):
    events = tracegen.generate(400, python=True, gpu=True, threads=2, layers_per_step=1, seed=3)
    doc = json.dumps({"traceEvents": [tracegen._json(e) for e in events]}).encode()
    report = casts.report(trace.parse(doc).tree(python=True))
    summary = report.summary(by)
    keys = len(casts.SUMMARY_KEYS[by])
    width = keys + (by in ("cause", "pass"))  # the keys, and the dtypes they hold
    found = {tuple(r[:keys]): (r[width], r[width + 1], r[width + 2]) for r in summary.rows}
    expected = _by_hand(report, by)
    assert found.keys() == expected.keys()
    assert len(found) > 1 or by == "pass"
    for k, (n, written, cpu) in expected.items():
        assert found[k][:2] == (n, written)
        assert found[k][2] == pytest.approx(round(cpu, 3), abs=1e-3)
    cpu_order = [r[width + 2] for r in summary.rows]
    assert cpu_order == sorted(cpu_order, reverse=True)


def test_renderings():
    report = report_of(*to_chain(BASE, [4], "float", "c10::BFloat16", "15"))
    assert "float32  bfloat16  1" in repr(report.summary("pair"))
    html = report._repr_html_()
    assert "<table" in html and "<p>1 cast</p>" in html and "gpu us" not in html
    assert json.loads(report.table().to_json())["rows"][0]["target"] == "bfloat16"


@pytest.mark.parametrize(
    "dtype", ["float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8"]
)
def test_scalar_type_codes_match_this_torch(dtype):
    import torch

    from mpguide.traces.profiling import profile_fn

    x = torch.ones(4, 8)
    target = getattr(torch, dtype)
    tree = profile_fn(lambda: x.to(target)).tree()
    (cast,) = casts.report(tree).casts
    assert (cast.source, cast.target) == ("float32", dtype)
    assert cast.bytes_written == 32 * target.itemsize


@pytest.mark.parametrize("parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_trace_keeping_only_the_args_casts_read_gives_the_same_report(
    tmp_path, monkeypatch, parallel
):
    path = tracegen.write(tmp_path / "t.json", 400, python=True, gpu=True, threads=2)
    if parallel:
        monkeypatch.setattr(trace, "PARALLEL_BYTES", 0)
    whole = casts.report(trace.load(path).tree(python=True))
    lean = trace.load(path, args_of=casts.needs_args)
    assert sum(map(len, lean.args.blobs)) < sum(map(len, trace.load(path).args.blobs)) / 2
    assert casts.report(lean.tree(python=True)).table() == whole.table()
    assert lean.tree().anomalies == trace.load(path).tree().anomalies
    add = lean.tree().find("aten::add")[0]
    with pytest.raises(MPGuideError, match=f"args of event {add.id} were not kept"):
        add.field("Input Dims")
    with pytest.raises(MPGuideError, match="module-level function"):
        trace.load(path, args_of=lambda name: True)


# -- Real GPU traces (tests/data/gpu; PROVENANCE.md says where each comes from) ---------------

GPU = DATA / "gpu"
H100_QWEN = GPU / "h100_qwen1.5-0.5b_bf16_inference.json.gz"
MI300_QWEN = GPU / "mi300x_qwen1.5-0.5b_bf16_inference.json.gz"
VLLM_GRAPH = GPU / "mi300x_vllm_decode_graph.json.gz"
B200_VLLM = GPU / "b200_vllm_gpt-oss_eager_window.json.gz"
A100_STEP = GPU / "a100_torchrec_train_step.json.gz"
A100_NO_SHAPES = GPU / "a100_alexnet_no_shapes.json.gz"


def real(path, python=True):
    """The tree and report the command line makes of a recorded trace."""
    tree = trace.load(path, args_of=casts.needs_args).tree(python=python)
    return tree, casts.report(tree)


def _innermost(node, predicate):
    return next((a.name for a in node.ancestors() if predicate(a)), None)


def test_a_stack_names_the_module_and_line_of_each_cast_on_h100():
    tree, report = real(H100_QWEN)
    assert len(report) == 101 and report.gpu
    for c in report:
        node = tree.node(c.id)
        module = _innermost(node, lambda a: a.name.startswith("nn.Module: "))
        frame = _innermost(node, lambda a: a.cat == "python_function" and "): " in a.name)
        file, _, rest = frame.partition("(")
        line = rest.split(")")[0]
        assert c.module == module.removeprefix("nn.Module: ").rsplit("_", 1)[0]
        assert c.cause == f"{c.module} ({file}:{line})"
    causes = {r["cause"]: r["casts"] for r in report.summary("cause").records()}
    norm = "Qwen2RMSNorm (transformers/models/qwen2/modeling_qwen2.py:218)"
    rotary = "Qwen2RotaryEmbedding (transformers/models/qwen2/modeling_qwen2.py:323)"
    assert causes == {norm: 98, rotary: 3}
    modules = report.summary("module").records()
    assert [(r["module"], r["casts"]) for r in modules] == [
        ("Qwen2RMSNorm", 98),
        ("Qwen2RotaryEmbedding", 3),
    ]
    # Each RMSNorm (24 layers x 2, and the last) casts its bf16 input up to float32 and the
    # result back; the rotary embedding casts cos and sin down and the positions up.
    found = Counter((c.module, c.source, c.target, c.shape) for c in report)
    assert found == {
        ("Qwen2RMSNorm", "bfloat16", "float32", (16, 559, 1024)): 49,
        ("Qwen2RMSNorm", "float32", "bfloat16", (16, 559, 1024)): 49,
        ("Qwen2RotaryEmbedding", "float32", "bfloat16", (1, 559, 64)): 2,
        ("Qwen2RotaryEmbedding", "int64", "float32", (1, 1, 559)): 1,
    }


def test_without_the_stack_the_cause_falls_back_to_the_op_and_says_why():
    _, report = real(H100_QWEN, python=False)
    assert {c.cause for c in report} == {casts.TOP_LEVEL} and {c.module for c in report} == {None}
    assert "python=True names modules and lines" in report.summary().notes[0]
    _, step = real(A100_STEP)
    assert "the trace has no Python stack" in step.summary().notes[0]


def test_the_same_model_on_mi300x_has_the_same_casts():
    _, h100 = real(H100_QWEN)
    _, mi300 = real(MI300_QWEN)

    def what(report):
        return sorted((c.cause, c.source, c.target, c.shape) for c in report)

    assert what(h100) == what(mi300)
    assert h100.gpu_us.sum() > 0 and mi300.gpu_us.sum() > 0


def test_cause_time_is_never_negative_on_an_epoch_microsecond_trace():
    tree, report = real(A100_STEP)
    # Whole microseconds since the epoch (1.7e15) times 1000 are past 2**53: converted to
    # nanoseconds at once, neighbours overlapped and a cast nested in the op before it.
    assert tree.trace.ts.min() > 2**53 / 1000
    assert tree.anomalies.overlaps == 0
    rows = report.summary("cause").records()
    assert rows and all(r["cause cpu us"] >= 0 and r["cause gpu us"] >= 0 for r in rows)
    assert "aten::as_strided" not in {r["cause"] for r in rows}
    for c in report:
        if c.cause_id is not None:
            cause = tree.node(c.cause_id)
            assert cause.start <= tree.node(c.id).start
            assert tree.node(c.id).start + c.cpu_us <= cause.start + cause.dur


def test_bytes_and_share_are_known_or_blank_never_zero():
    _, report = real(A100_STEP)
    # The int32 -> int64 casts of this trace name their source 'long'.
    up = [c for c in report if (c.source, c.target) == ("int32", "int64")]
    assert up and all(c.direction == "up-cast" for c in up)
    rows = report.summary("cause", scalars=True).records()
    for r in rows:
        mine = [c for c in report if c.cause == r["cause"]]
        assert r["bytes written"] == sum(c.bytes_written for c in mine)
        assert r["share of step"] > 0
    assert all(c.share > 0 for c in report)
    _, graph = real(VLLM_GRAPH)
    assert graph.step_us is None and all(c.share is None for c in graph)
    summary = graph.summary("cause")
    assert all(r["share of step"] is None for r in summary.records())
    assert "share of step is blank: the trace has no ProfilerStep#N range" in summary.notes
    shapeless = report_of(op("aten::copy_", BASE, 5.0, **{"Input type": ["float", "double"]}))
    table = shapeless.summary("pair")
    assert table.records()[0]["bytes written"] is None
    assert "bytes are blank where the trace has no shape for the cast" in table.notes
    assert "float64  float32  1" in table.to_text()


def test_copy_chains_without_dtypes_are_counted_not_dropped():
    tree, report = real(A100_NO_SHAPES)
    chains = [n for n in tree.find("aten::to") if n.parent is None or n.parent.name != "aten::to"]
    assert len(report) == 0 and report.untyped == len(chains) == 20
    assert report.summary().notes[0].startswith("20 copy chains name no dtypes")


def test_inductor_convert_kernels_in_a_graph_replay_are_fused_casts():
    tree, report = real(VLLM_GRAPH)
    kernels = tree.find("triton_poi_fused__to_copy_1")
    assert len(kernels) == 23 and all(k.is_gpu for k in kernels)
    assert set(report.fused.ids.tolist()) == {k.id for k in kernels}
    assert not set(report.ids.tolist()) & {k.id for k in kernels}
    (row,) = report.fused.table().records()
    assert row["kind"] == "compiled" and row["kernels"] == 23 and row["device"] == "gpu"
    assert row["kernel us"] == pytest.approx(sum(k.dur for k in kernels), abs=1e-3)
    # The innermost frame, torch/cuda/graphs.py's replay, is torch's: vLLM's line called it.
    assert row["cause"] == "__call__ (vllm/compilation/cuda_graph.py:208)"


def test_vendor_convert_and_quantize_kernels_are_fused_casts():
    tree, report = real(B200_VLLM)
    rows = {r["kind"]: r for r in report.fused.table().records()}
    norm = [k for k in tree.find(predicate=lambda n: n.is_gpu) if "_typeConvert" in k.name]
    assert rows["vendor"]["kernel"] == "vllm::fused_add_rms_norm_kernel [vllm::_typeConvert]"
    assert rows["vendor"]["kernels"] == len(norm) == 10
    assert rows["vendor"]["kernel us"] == pytest.approx(sum(k.dur for k in norm), abs=1e-3)
    assert rows["vendor"]["cause"] == "RMSNorm (vllm/_custom_ops.py:334), _C::fused_add_rms_norm"
    quantized = {r["kernel"] for r in report.fused.table().records() if r["kind"] == "quantize"}
    assert quantized == {
        "vllm::scaled_fp8_quant_kernel_strided",
        "tensorrt_llm::kernels::quantize_with_block_size",
    }


def test_copy_kernels_inside_aten_casts_are_not_fused_casts():
    tree, report = real(H100_QWEN)
    copies = [
        n for n in tree.find(predicate=lambda n: n.is_gpu) if "bfloat16_copy_kernel" in n.name
    ]
    inside = [k for k in copies if any(a.name in casts.CAST_OPS for a in k.ancestors())]
    assert len(copies) == 73 and len(inside) == 51
    assert set(report.fused.ids.tolist()) == {k.id for k in copies} - {k.id for k in inside}
    # The others ran before the profiled step: their launches are not in the trace.
    assert all(k.parent is None for k in copies if k not in inside)
    assert {r["cause"] for r in report.fused.table().records()} == {casts.NO_LAUNCH}


BF16_COPY = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, "
    "at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}, "
    "std::array<char*, 2ul>)"
)
VLLM_NORM = (
    "std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type "
    "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long, float, int)"
)
DIRECT_COPY = (
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#2}, at::detail::Array<char*, 2>, "
    "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)"
)


@pytest.mark.parametrize(
    ("name", "kind", "label"),
    [
        ("triton_poi_fused__to_copy_1", "compiled", "triton_poi_fused__to_copy_1"),
        (
            BF16_COPY,
            "copy kernel",
            "at::native::vectorized_elementwise_kernel [at::native::bfloat16_copy_kernel_cuda]",
        ),
        (VLLM_NORM, "vendor", "vllm::fused_add_rms_norm_kernel [vllm::_typeConvert]"),
        ("SubTensorOpWithCastTensor1d", "vendor", "SubTensorOpWithCastTensor1d"),
        ("aten::_to_copy", None, "aten::_to_copy"),
        ("vllm::rocm_unquantized_gemm", None, "vllm::rocm_unquantized_gemm"),
        ("UnquantizedFusedMoEMethod", None, "UnquantizedFusedMoEMethod"),
        ("dynamic_per_token_scaled_fp8_quant", "quantize", "dynamic_per_token_scaled_fp8_quant"),
        ("_C::dequantize_kernel", "quantize", "_C::dequantize_kernel"),
        (DIRECT_COPY, None, "at::native::unrolled_elementwise_kernel"),
    ],
)
def test_fused_kernel_names(name, kind, label):
    assert casts.fused_kind(name) == kind
    assert casts.kernel_label(name) == label


def test_scalar_casts_fold_into_one_row_and_limit_says_what_it_left_out():
    _, report = real(A100_STEP)
    scalar = [c for c in report if c.shape == ()]
    assert len(scalar) == 1 and len(report) == 18
    folded = report.summary("cause", scalars=False)
    *rows, last = folded.records()
    assert last["cause"] == casts.FOLDED and last["casts"] == len(scalar)
    assert last["cpu us"] == pytest.approx(sum(c.cpu_us for c in scalar), abs=1e-3)
    assert sum(r["casts"] for r in rows) == len(report) - len(scalar)
    every = report.summary("cause", scalars=True).records()
    assert casts.FOLDED not in {r["cause"] for r in every}
    assert sum(r["casts"] for r in every) == len(report)
    table = report.table(scalars=False, limit=5)
    assert len(table.rows) == 6 and table.rows[-1][2] == "(0-d casts: 1, folded)"
    assert table.notes[0] == "... 12 more rows not shown (5 of 17)"
    assert [r[0] for r in table.rows[:5]] == [c.id for c in report if c.shape != ()][:5]
    with pytest.raises(MPGuideError, match="limit must be 1 or more"):
        report.table(limit=0)


def test_a_live_training_step_folds_the_optimizers_scalar_casts_and_ties_its_backward():
    import torch

    from mpguide.traces.profiling import profile_fn

    class Norm(torch.nn.Module):
        def forward(self, x):
            return x.float().pow(2).mean(-1, keepdim=True).to(x.dtype) * x

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), Norm()).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(8, 16, dtype=torch.bfloat16)

    def step():
        model(x).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    report = casts.report(profile_fn(step, with_stack=True).tree(python=True))
    scalar = [c for c in report if c.scalar]
    # Adam's casts are torch's frames' (torch/optim/adam.py): named by the line that stepped.
    stepped = [c for c in report if c.cause.startswith("step (") and "test_casts.py:" in c.cause]
    adam = [c for c in stepped if c.scalar]
    assert adam and all(c.bytes_written <= 8 and not c.backward for c in adam)
    assert len(adam) > len(report) / 2, Counter(c.cause for c in report)
    norm = [c for c in report if c.module == "Norm"]
    assert {(c.pass_, c.source, c.target) for c in norm} >= {
        ("forward", "bfloat16", "float32"),
        ("backward", "float32", "bfloat16"),
    }
    by_id = {c.id: c for c in report}
    for c in (c for c in norm if c.backward):
        assert by_id[c.forward_id].module == "Norm" and not by_id[c.forward_id].backward
    by_module = report.summary("module", scalars=False).records()
    (folded,) = [r for r in by_module if r["module"] == casts.FOLDED]
    assert folded["casts"] == len(scalar)
    assert [r["cpu us"] for r in by_module] == sorted(
        (r["cpu us"] for r in by_module), reverse=True
    )


def test_a_cast_is_not_blamed_on_a_module_that_ended_before_it():
    """Python events that overlap: the cast starts inside Early's event and ends after it, so
    nesting puts it under Early; Early does not hold it in time, and the report says so."""

    def report_with(early_dur):
        events = [
            op("nn.Module: Early_0", BASE, early_dur, cat="python_function"),
            *to_chain(BASE + 8, [64], "float", "c10::BFloat16", "15"),
        ]
        doc = json.dumps({"traceEvents": events}).encode()
        return casts.report(trace.parse(doc).tree(python=True))

    ended, held = report_with(10.0), report_with(30.0)
    assert [c.module for c in ended] == [None] and [c.module for c in held] == ["Early"]
    assert any("Python events overlap: 1 casts nest under a module" in n for n in ended.notes)
    assert not any("overlap" in n for n in held.notes)


def test_a_cause_node_shared_by_two_rows_counts_in_each_and_none_is_blank():
    """One module holds two frames, each with a cast: two rows by cause, one causing node (the
    module, 100 µs) that each row credits, less its own cast (10 µs); a cast at top level has
    no causing node: blank, not 0."""
    module_us, cast_us = 100.0, 10.0
    events = [
        op("nn.Module: Linear_0", BASE, module_us, cat="python_function"),
        op("model.py(10): first", BASE + 1, 30.0, cat="python_function"),
        *to_chain(BASE + 5, [8], "float", "c10::BFloat16", "15", dur=cast_us),
        op("model.py(20): second", BASE + 40, 40.0, cat="python_function"),
        *to_chain(BASE + 45, [8], "c10::BFloat16", "float", "6", dur=cast_us),
        *to_chain(BASE + 200, [8], "float", "c10::Half", "5", dur=cast_us),
    ]
    doc = json.dumps({"traceEvents": events}).encode()
    report = casts.report(trace.parse(doc).tree(python=True))
    rows = {r["cause"]: r["cause cpu us"] for r in report.summary("cause").records()}
    assert rows == {
        "Linear (model.py:10)": module_us - cast_us,
        "Linear (model.py:20)": module_us - cast_us,
        "(top level)": None,
    }


def test_recorded_cuda_step_casts_every_linear_weight_on_kernels():
    """A bf16-autocast training step of a 4-layer encoder recorded by mpguide on an H100
    (tests/data/gpu/PROVENANCE.md): every Linear weight is cast down in forward and its
    gradient up in backward, and every tensor cast ran a kernel."""
    rep = casts.report(trace.load(DATA / "gpu" / "h100_mpguide_bf16_train_step.json.gz").tree())
    weights = Counter({(3072, 1024): 4, (1024, 1024): 4, (4096, 1024): 4, (1024, 4096): 4})
    weights[(10, 262144)] = 1
    down = Counter(
        c.shape
        for c in rep
        if c.cause == "aten::linear" and not c.backward and c.source == "float32"
    )
    up = Counter(c.shape for c in rep if c.backward and c.target == "float32")
    for shape, n in weights.items():
        assert down[shape] == up[shape] == n, shape
    assert all(c.forward_id is not None for c in rep if c.backward and c.target == "float32")
    assert rep.gpu and all(c.gpu_us > 0 for c in rep if c.shape)
    cast_us, step_us, share = rep.share_of_steps(gpu=True)
    # The step's kernels: 5,806.4 us launched by the main thread under ProfilerStep#N, and
    # 11,434.6 us by autograd's engine thread (tid 553) during the step, outside its node.
    assert cast_us == pytest.approx(1349.885, abs=1e-3)
    assert step_us == pytest.approx(17240.947, abs=1e-3)
    assert f"{share:.1%}" == "7.8%"


def _launched_by_thread(tree):
    """The kernel time of the step, by the thread that launched it: what the share's
    denominator is made of, read from the tree one kernel at a time."""
    (step,) = tree.steps()
    found = Counter()
    for k in tree.find(predicate=lambda n: n.is_gpu and n.parent is not None):
        launch = k.parent
        if step.start <= launch.start < step.start + step.dur:
            found[tree.trace.tid.value(launch.id)] += k.dur
    return step, found


def test_the_step_counts_the_kernels_the_backward_thread_launched():
    tree, report = real(GPU / "h100_mpguide_bf16_train_step.json.gz")
    step, by_thread = _launched_by_thread(tree)
    assert tree.trace.tid.value(step.id) == 512 and set(by_thread) == {512, 553}
    assert by_thread[512] == pytest.approx(step.gpu_time) == pytest.approx(5806.378, abs=1e-3)
    assert by_thread[553] == pytest.approx(11434.569, abs=1e-3)
    assert report.step_gpu_us == pytest.approx(sum(by_thread.values()))


@pytest.mark.parametrize(
    ("path", "kernel_us", "under_node_us"),
    [
        (A100_STEP, 81184.0, 27599.0),  # DDP: the backward thread's and NCCL's launches
        (DATA / "ranks" / "sampled_rank-0.json.gz", 607844.0, 361938.0),
        (DATA / "ranks" / "sampled_rank-1.json.gz", 667530.0, 350183.0),
        (H100_QWEN, 31905.473, 31905.473),  # inference: one thread launches all
        (MI300_QWEN, 29743.938, 29743.938),
    ],
)
def test_step_kernel_time_of_the_recorded_traces(path, kernel_us, under_node_us):
    tree, report = real(path, python=False)
    steps = tree.steps()
    assert report.step_gpu_us == pytest.approx(kernel_us, abs=1e-3)
    assert sum(s.gpu_time for s in steps) == pytest.approx(under_node_us, abs=1e-3)


def test_kernels_launched_during_the_step_by_another_thread_count_and_others_do_not():
    """A step on thread 1; thread 2 launches one kernel during it, one after it; a launch of
    another process during it does not count, nor a kernel without a launch (alone, or in a
    GPU range)."""

    def launch(ts, corr, tid, pid=1):
        return {
            **op("cudaLaunchKernel", ts, 2.0, "cuda_runtime", tid, correlation=corr),
            "pid": pid,
        }

    def kernel(ts, dur, corr):
        return {**op("kernel_x", ts, dur, "kernel", 7, correlation=corr), "pid": 0}

    events = [
        op("ProfilerStep#1", BASE, 100.0, "user_annotation"),
        launch(BASE + 10, 1, 1),
        kernel(BASE + 20, 5.0, 1),
        launch(BASE + 50, 2, 2),
        kernel(BASE + 60, 7.0, 2),
        launch(BASE + 150, 3, 2),
        kernel(BASE + 160, 11.0, 3),
        launch(BASE + 40, 4, 1, pid=2),
        kernel(BASE + 45, 13.0, 4),
        kernel(BASE + 70, 17.0, 99),
        # A GPU range holding a kernel without a launch, in the step's process: not a launch.
        op("gpu_range", BASE + 60, 30.0, "gpu_user_annotation", 7),
        op("kernel_y", BASE + 62, 19.0, "kernel", 7, correlation=98),
    ]
    report = report_of(*events)
    assert report.step_gpu_us == 5.0 + 7.0


def test_a_graph_capture_counts_its_kernels_not_the_capture_time_ops():
    """The shape of a CUDA/HIP graph capture trace (xdit's and vLLM's): the inductor kernel's
    CPU op ran at capture and launched nothing; the graph's replay launched the kernels. A
    plain GEMM named "unquantized" converts nothing."""
    fused = "triton_red_fused__to_copy_view_24"
    events = [
        op(fused, BASE, 20.0),
        op("cpp_fused__to_copy_add_0", BASE + 22, 6.0),  # inductor's CPU kernel: CPU work
        op("vllm::rocm_unquantized_gemm", BASE + 30, 40.0),
        op("hipGraphLaunch", BASE + 100, 5.0, "cuda_runtime", correlation=5),
        {**op(fused, BASE + 110, 3.0, "kernel", 7, correlation=5), "pid": 0},
        {**op(fused, BASE + 120, 4.0, "kernel", 7, correlation=5), "pid": 0},
        {**op("Cijk_gemm", BASE + 130, 9.0, "kernel", 7, correlation=5), "pid": 0},
    ]
    report = report_of(*events)
    fused_casts = report.fused
    row, cpu = fused_casts.table().records()
    assert (row["kernel"], row["device"], row["kernels"], row["kernel us"]) == (fused, "gpu", 2, 7)
    assert (cpu["kernel"], cpu["device"], cpu["kernel us"]) == (
        "cpp_fused__to_copy_add_0",
        "cpu",
        6,
    )
    assert row["cause"] == casts.TOP_LEVEL  # a launch is not a cause
    assert (fused_casts.cpu_only, fused_casts.cpu_only_us) == (1, 20.0)
    note = "1 CPU events named like fused cast kernels launched no GPU work (20.0 µs of CPU time"
    assert any(n.startswith(note) for n in report.summary().notes)
    assert fused_casts.table().caption.startswith("3 fused cast kernels, 13.0 µs")


@pytest.mark.parametrize(
    ("shape", "kept"),
    [
        ((2**31, 2**31, 2), False),  # 2**63 elements: more than int64 counts
        ((2**31, 2**31 - 1, 2), True),
        ((3, -1), False),
        ((0, 2**70), True),  # no element
        ((1,) * 100, True),
    ],
)
def test_a_shape_is_kept_when_a_tensor_can_have_it(shape, kept):
    (cast,) = report_of(*to_chain(BASE, list(shape), "float", "c10::BFloat16", "15"))
    assert (cast.shape == shape) is kept and (cast.shape is None) is not kept


def test_a_cast_of_a_million_dims_costs_time_linear_in_its_dims():
    """A hostile trace: one cast whose shape lists a million dims of 2. Their product, taken
    whole, costs time that grows as the square of the dims (math.prod took 27 s for a
    million where this was written, and five million never finished); bounded, the report
    takes a fraction of a second."""
    import time

    dims = [2] * 1_000_000
    events = [
        op(
            "aten::to",
            BASE,
            10.0,
            **{
                "Input type": ["float", "Scalar"],
                "Input Dims": [dims, []],
                "Concrete Inputs": ["", "15"],
            },
        )
    ]
    began = time.perf_counter()
    (cast,) = report_of(*events)
    assert time.perf_counter() - began < 8.0
    assert (cast.source, cast.target, cast.shape) == ("float32", "bfloat16", None)


def test_a_cast_climbs_to_the_outer_module_when_the_inner_one_ended_before_it():
    """Outer holds the cast in time; Inner, nested in Outer, ends while the cast runs, so
    nesting puts the cast under Inner. The cause is Outer, and the note says why."""
    events = [
        op("nn.Module: Outer_0", BASE, 100.0, cat="python_function"),
        op("nn.Module: Inner_0", BASE + 2, 10.0, cat="python_function"),
        *to_chain(BASE + 8, [64], "float", "c10::BFloat16", "15"),
    ]
    doc = json.dumps({"traceEvents": events}).encode()
    tree = trace.parse(doc).tree(python=True)
    (cast,) = casts.report(tree)
    assert tree.node(cast.id).parent.name == "nn.Module: Inner_0"
    assert (cast.module, cast.cause) == ("Outer", "Outer")
    notes = casts.report(tree).notes
    assert any("1 casts nest under a module or line whose event had ended" in n for n in notes)


def test_the_folded_row_is_sorted_with_the_others():
    """Many 0-d casts (an optimizer's) take more time than the one tensor cast: their folded
    row comes first, as the largest; with a limit of one row it is the row shown."""
    events = [
        op("aten::mul", BASE, 300.0),
        *(
            e
            for k in range(5)
            for e in to_chain(BASE + 1 + 50 * k, [], "float", "double", "7", dur=40.0)
        ),
        op("aten::linear", BASE + 400, 30.0),
        *to_chain(BASE + 405, [8, 8], "float", "c10::BFloat16", "15", dur=10.0),
    ]
    report = report_of(*events)
    rows = report.summary("cause", scalars=False).records()
    assert [(r["cause"], r["casts"]) for r in rows] == [(casts.FOLDED, 5), ("aten::linear", 1)]
    (shown,) = report.summary("cause", scalars=False, limit=1).records()
    assert shown["cause"] == casts.FOLDED
    by_cast = report.table("cast", scalars=False).records()
    assert by_cast[-1]["cause"] == "(0-d casts: 5, folded)"
