import json
from pathlib import Path

import pytest

from mpguide import MPGuideError, casts, trace, tracegen

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


def test_real_train_step_finds_backward_casts():
    report = casts.report(trace.load(DATA / "train_step.json.gz").tree())
    backward = [c for c in report if c.backward]
    assert backward and all(c.pass_ == "backward" for c in backward)
    assert any(c.cause == "ToCopyBackward0" and c.source == "bfloat16" for c in backward)
    forward_linear = [c for c in report if c.cause == "aten::linear"]
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
    assert row["cpu us"] == 10.0 and row["op cpu us"] == 90.0


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


def test_compiled_convert_kernels_are_casts_of_unknown_dtypes():
    (cast,) = report_of(op("cpp_fused__to_copy_add_0", BASE, 5.0))
    assert cast.source == cast.target == "?" and cast.direction == "?"


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
    width = len(casts.SUMMARY_KEYS[by])
    found = {tuple(r[:width]): (r[width], r[width + 1], r[width + 2]) for r in summary.rows}
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
    assert "<table" in html and "1 cast in" in html and "gpu us" not in html
    assert json.loads(report.table().to_json())["rows"][0]["target"] == "bfloat16"


@pytest.mark.parametrize(
    "dtype", ["float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8"]
)
def test_scalar_type_codes_match_this_torch(dtype):
    import torch

    from mpguide.profiling import profile_fn

    x = torch.ones(4, 8)
    target = getattr(torch, dtype)
    tree = profile_fn(lambda: x.to(target)).tree()
    (cast,) = casts.report(tree).casts
    assert (cast.source, cast.target) == ("float32", dtype)
    assert cast.bytes_written == 32 * target.itemsize


@pytest.mark.parametrize("parallel", [False, True])
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
