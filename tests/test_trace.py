import gzip
import io
import json
import math
from collections import Counter
from operator import attrgetter
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpguide import MPGuideError
from mpguide.core import units
from mpguide.traces import calltree, halves, nesting, trace, tracegen

DATA = Path(__file__).parent / "data"
BASE = 4_402_438_546_149.513


def op(name, ts, dur, cat="cpu_op", pid=1, tid=1, **args):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def tree_of(*events, python=True, **kw):
    doc = {"traceEvents": list(events)}
    return trace.parse(json.dumps(doc).encode()).tree(python=python, **kw)


def placed_once(tree):
    """Every included event is reached exactly once walking down from the roots."""
    seen = [n.id for nodes in tree.roots().values() for root in nodes for n in root.walk()]
    return sorted(seen) == sorted(i for i in range(len(tree.included)) if tree.included[i])


def parent_name(tree, i):
    p = tree.node(i).parent
    return None if p is None else p.name


# Real traces recorded on this machine by tests/data/record.py


def test_real_autocast_matmul_tree():
    tr = trace.load(DATA / "autocast_matmul.json.gz")
    tree = tr.tree()
    assert placed_once(tree)
    assert tree.anomalies.total() == 0
    (step,) = tree.find(predicate=lambda n: n.name.startswith("ProfilerStep#"))
    outer = next(n for n in step.children if n.name == "aten::matmul")
    assert outer.field("Input type") == ["c10::BFloat16", "float"]
    kids = [c.name for c in outer.children]
    assert kids == ["aten::to", "aten::matmul"]
    chain = [n.name for n in outer.children[0].walk()]
    assert chain[:2] == ["aten::to", "aten::_to_copy"] and "aten::copy_" in chain
    assert outer.self_time == pytest.approx(outer.dur - sum(c.dur for c in outer.children))
    assert outer.gpu_time == 0


def test_real_train_step_has_backward_nodes():
    tree = trace.load(DATA / "train_step.json.gz").tree()
    assert placed_once(tree)
    names = {n.name for n in tree.find()}
    assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
    assert "ToCopyBackward0" in names


def test_python_layer_is_optional_and_counted():
    py = op("model.py(3): forward", BASE, 100.0, cat="python_function")
    mm = op("aten::mm", BASE + 10, 50.0)
    without = tree_of(py, mm, python=False)
    assert without.hidden == {"python_function": 1} and len(without) == 1
    with_py = tree_of(py, mm)
    assert parent_name(with_py, 1) == "model.py(3): forward"
    no_annotations = tree_of(
        op("ProfilerStep#1", BASE, 100.0, cat="user_annotation"), mm, annotations=False
    )
    assert no_annotations.hidden == {"user_annotation": 1} and no_annotations.node(1).parent is None


# Nesting edge cases: each has a defined place and is counted


def test_overlap_stays_under_the_parent_it_starts_in():
    tree = tree_of(
        op("parent", BASE, 10.0), op("late", BASE + 5, 10.0), op("inside late", BASE + 12, 1.0)
    )
    assert parent_name(tree, 1) == "parent"
    assert parent_name(tree, 2) == "late"
    assert tree.anomalies.overlaps == 1
    assert placed_once(tree)


def test_event_at_parent_end_is_a_sibling():
    tree = tree_of(op("a", BASE, 10.0), op("b", BASE + 10, 5.0), op("zero", BASE + 15, 0.0))
    assert tree.node(1).parent is None and tree.node(2).parent is None
    assert tree.anomalies.touching == 2
    assert placed_once(tree)


def test_identical_intervals_nest_in_file_order():
    tree = tree_of(op("first", BASE, 10.0), op("second", BASE, 10.0))
    assert parent_name(tree, 1) == "first"
    assert tree.anomalies.identical == 1


def test_identical_intervals_nest_by_layer_before_file_order():
    tree = tree_of(
        op("aten::add", BASE, 10.0),
        op("f.py(1): f", BASE, 10.0, "python_function"),
        op("range", BASE, 10.0, "user_annotation"),
    )
    assert parent_name(tree, 1) == "range"
    assert parent_name(tree, 0) == "f.py(1): f"


def test_float_rounding_cannot_mis_nest():
    # Both end at ...948155.971 us, but in binary floating point the child ends later.
    parent = op("parent", 4421659939713.062, 8442.909)
    child = op("child", 4421659947910.781, 245.19)
    assert child["ts"] + child["dur"] > parent["ts"] + parent["dur"]
    tree = tree_of(parent, child)
    assert parent_name(tree, 1) == "parent"
    assert tree.anomalies.overlaps == 0


def test_threads_and_processes_get_their_own_trees():
    tree = tree_of(
        op("a", BASE, 10.0), op("b", BASE + 1, 1.0, tid=2), op("c", BASE + 1, 1.0, pid=2)
    )
    assert len(tree.roots()) == 3
    assert all(tree.node(i).parent is None for i in range(3))


def test_bad_times_are_an_error_naming_the_event():
    with pytest.raises(MPGuideError, match=r"event 1 \('b'\): negative dur"):
        tree_of(op("a", BASE, 1.0), op("b", BASE, -1.0))
    with pytest.raises(MPGuideError, match=r"event 0 \('a'\): ts .* beyond"):
        tree_of(op("a", 1e16, 1.0))
    with pytest.raises(MPGuideError, match=r"event 0 \('a'\): ts \+ dur .* beyond"):
        tree_of(op("a", BASE, 9e15))
    flow_far = {"ph": "s", "cat": "ac2g", "id": 1, "pid": 1, "tid": 1, "ts": 1e300}
    assert len(tree_of(op("a", BASE, 1.0), flow_far)) == 1


# GPU events


def launch(ts, corr, name="cudaLaunchKernel", cat="cuda_runtime", pid=1):
    return op(name, ts, 5.0, cat=cat, pid=pid, correlation=corr)


def kernel(ts, corr, dur=20.0, pid=0, cat="kernel"):
    return op(f"kernel_{corr}", ts, dur, cat=cat, pid=pid, tid=7, correlation=corr)


def test_kernels_hang_under_their_launch_and_count_in_gpu_time():
    tree = tree_of(
        op("aten::mm", BASE, 20.0),
        launch(BASE + 2, 7),
        kernel(BASE + 30, 7, 40.0),
        kernel(BASE + 100, 8),
    )
    assert parent_name(tree, 1) == "aten::mm"
    assert parent_name(tree, 2) == "cudaLaunchKernel"
    assert tree.node(0).gpu_time == 40.0
    assert tree.node(0).self_time == 15.0
    assert tree.node(3).parent is None and tree.anomalies.unlinked_gpu == 1
    assert placed_once(tree)
    text = tree.render(fields=[])
    assert "kernel_7" not in text and "cudaLaunchKernel" in text
    assert "kernel_7" in tree.render(fields=[], gpu=True)


def test_gpu_side_ranges_are_hidden_by_default_and_not_gpu_work():
    tree = tree_of(
        op("ProfilerStep#1", BASE, 100.0, cat="user_annotation"),
        launch(BASE + 2, 7),
        kernel(BASE + 30, 7, 40.0),
        op("ProfilerStep#1", BASE + 25, 80.0, cat="gpu_user_annotation", pid=0, tid=7),
    )
    assert tree.node(3).is_gpu and tree.node(3).gpu_time == 0
    assert tree.node(0).gpu_time == 40.0 and tree.anomalies.unlinked_gpu == 0
    assert tree.render(fields=[]).count("ProfilerStep#1") == 1
    assert tree.render(fields=[], gpu=True).count("ProfilerStep#1") == 2


@pytest.mark.parametrize(
    ("name", "cat"),
    [
        ("hipLaunchKernel", "cuda_runtime"),
        ("hipLaunchKernel", "hip_runtime"),
        ("cudaMemcpyAsync", "cuda_runtime"),
    ],
)
def test_rocm_launches_and_memcpys_link(name, cat):
    tree = tree_of(launch(BASE, 3, name, cat), kernel(BASE + 10, 3, cat="gpu_memcpy"))
    assert parent_name(tree, 1) == name


def test_a_graph_launch_fans_out_to_all_its_kernels():
    tree = tree_of(
        launch(BASE, 5, "cudaGraphLaunch"), *(kernel(BASE + 10 + 30 * k, 5) for k in range(3))
    )
    assert [c.id for c in tree.node(0).children] == [1, 2, 3]
    assert tree.node(0).gpu_time == 60.0


def flow(ph, ts, key, pid, tid):
    return {"ph": ph, "cat": "ac2g", "name": "ac2g", "id": key, "pid": pid, "tid": tid, "ts": ts}


def steps(events, keep):
    """The events of the profiler steps numbered in ``keep``, parents renumbered."""
    step = np.cumsum([e["name"].startswith("ProfilerStep#") for e in events]) - 1
    kept = [k for k in range(len(events)) if step[k] in keep]
    new = {k: i for i, k in enumerate(kept)}
    return [
        {**events[k], "parent": new.get(events[k]["parent"], events[k]["parent"])} for k in kept
    ]


def two_ranks(shifted_windows):
    """Two ranks of the same program merged into one trace, with colliding correlation ids:
    rank 1 runs 1.5 us behind rank 0, so each of rank 0's kernels starts after rank 1's
    launch with its id. With ``shifted_windows`` the ranks' profiled windows differ by one
    step, so each rank also has ids of its own."""
    ranks = [
        list(
            tracegen.generate(
                3 * tracegen._LAYER_OPS,
                gpu=True,
                layers_per_step=1,
                pid=10 + r,
                gpu_pid=r,
                offset_ns=1_500 * r,
            )
        )
        for r in range(2)
    ]
    if shifted_windows:
        ranks = [steps(ranks[0], {0, 1}), steps(ranks[1], {1, 2})]
    merged = ranks[0] + [
        {**e, "parent": e["parent"] + len(ranks[0]) if e["parent"] >= 0 else e["parent"]}
        for e in ranks[1]
    ]
    doc = {"traceEvents": [tracegen._json(e) for e in merged]}
    return merged, trace.parse(json.dumps(doc).encode()).tree()


def check_against_truth(generated, tree, kernels_linked=True):
    nodes = [k for k, e in enumerate(generated) if e["ph"] == "X"]
    node_of = {k: i for i, k in enumerate(nodes)}
    for k in nodes:
        want = generated[k]["parent"]
        if generated[k]["cat"] == "kernel" and not kernels_linked:
            want = -1
        assert tree.parent[node_of[k]] == (node_of[want] if want >= 0 else -1)


@pytest.mark.parametrize("drop_flows", [False, True])
def test_merged_ranks_with_colliding_ids_link_within_their_rank(drop_flows):
    generated, _ = two_ranks(shifted_windows=True)
    kept = [e for e in generated if not (drop_flows and e["cat"] == "ac2g")]
    doc = {"traceEvents": [tracegen._json(e) for e in kept]}
    tree = trace.parse(json.dumps(doc).encode()).tree()
    kernels = sum(e["cat"] == "kernel" for e in generated)
    assert tree.anomalies.shared_correlation == kernels // 2  # the step both ranks profiled
    assert tree.anomalies.ambiguous_gpu == 0 and tree.anomalies.unlinked_gpu == 0
    check_against_truth(generated, tree)
    gpu_time = [sum(n.gpu_time for n in roots) for roots in tree.roots().values()]
    assert min(gpu_time) > 0


def test_merged_ranks_whose_ids_all_collide_leave_kernels_unlinked():
    generated, tree = two_ranks(shifted_windows=False)
    kernels = sum(e["cat"] == "kernel" for e in generated)
    assert tree.anomalies.shared_correlation == kernels
    assert tree.anomalies.ambiguous_gpu == tree.anomalies.unlinked_gpu == kernels
    check_against_truth(generated, tree, kernels_linked=False)
    assert placed_once(tree)


def test_flow_ids_decide_where_correlation_ids_collide():
    tree = tree_of(
        launch(BASE, 1, pid=10),
        launch(BASE + 1, 1, pid=20),
        kernel(BASE + 10, 1, pid=0),
        kernel(BASE + 11, 1, pid=1),
        flow("s", BASE, 101, 10, 1),
        flow("s", BASE + 1, 201, 20, 1),
        flow("f", BASE + 10, 101, 0, 7),
        flow("f", BASE + 11, 201, 1, 7),
    )
    assert tree.node(2).parent.id == 0 and tree.node(3).parent.id == 1
    assert tree.anomalies.shared_correlation == tree.anomalies.unlinked_gpu == 0
    assert placed_once(tree)


def test_colliding_ids_link_in_the_kernels_own_process():
    tree = tree_of(
        launch(BASE, 1, pid="rank0"),
        launch(BASE + 1, 1, pid="rank1"),
        kernel(BASE + 10, 1, pid="rank0"),
        kernel(BASE + 11, 1, pid="rank1"),
    )
    assert tree.node(2).parent.id == 0 and tree.node(3).parent.id == 1
    assert tree.anomalies.shared_correlation == 2 and tree.anomalies.ambiguous_gpu == 0


def test_string_correlation_ids_link():
    tree = tree_of(launch(BASE, "a1"), kernel(BASE + 10, "a1"), kernel(BASE + 20, 1))
    assert tree.node(1).parent.id == 0 and tree.anomalies.unlinked_gpu == 1


def test_repeated_ids_in_one_process_take_the_latest_earlier_launch():
    tree = tree_of(launch(BASE, 1), launch(BASE + 50, 1), kernel(BASE + 60, 1))
    assert tree.node(2).parent.id == 1
    assert tree.anomalies.shared_correlation == 0


# Reading files


def test_load_json_gzip_and_bare_list(tmp_path):
    events = [op("a", BASE, 10.0), {"ph": "M", "name": "process_name", "pid": 1, "tid": 0}]
    plain = tmp_path / "t.json"
    plain.write_text(json.dumps({"traceEvents": events}))
    gz = tmp_path / "t.json.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(events))
    for path in (plain, gz, bare):
        tr = trace.load(path)
        assert [e.name for e in tr.events] == ["a"]
        assert tr.other == {"M": 1}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"traceEvents": [{"ph": "X", "na', "not valid JSON"),
        (b"hello", "not valid JSON"),
        (b'{"events": []}', "not a chrome trace"),
        (b'{"traceEvents": [{"ph": "X", "ts": "soon"}]}', "not a chrome trace"),
        (b"[1, 2]", "not a chrome trace"),
        (b"\x1f\x8b\x08\x00truncated", "broken gzip"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(MPGuideError, match=message) as err:
        trace.load(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def same_trace(a, b):
    """Two traces hold the same events, fields, args and other events."""
    assert len(a) == len(b) and a.other == b.other
    for column in ("name", "cat", "pid", "tid", "ts", "dur"):
        assert list(map(attrgetter(column), a.events)) == list(map(attrgetter(column), b.events))
    ids = np.arange(len(a))
    assert a.args.raws(ids) == b.args.raws(ids)


def write_generated(path, ops, layout, **options):
    events = [tracegen._json(e) for e in tracegen.generate(ops, **options)]
    doc = events if layout == "list" else {"schemaVersion": 1, "traceEvents": events, "x": [1]}
    compact = (",", ":") if layout == "compact" else None
    path.write_text(json.dumps(doc, indent=2 if layout == "indented" else None, separators=compact))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["object", "indented", "list"])
def test_large_files_decode_in_two_processes_as_in_one(tmp_path, monkeypatch, layout):
    path = write_generated(tmp_path / "t.json", 300, layout, python=True, gpu=True, threads=2)
    serial = trace.parse(path.read_bytes(), str(path))
    monkeypatch.setattr(trace, "PARALLEL_BYTES", 0)
    parts = trace._in_halves(path, None)
    assert parts is not None and all(len(h.ts) for h in parts)
    same_trace(trace.load(path), serial)


def test_a_real_export_splits_at_an_event(tmp_path, monkeypatch):
    path = tmp_path / "train_step.json"
    path.write_bytes(gzip.decompress((DATA / "train_step.json.gz").read_bytes()))
    monkeypatch.setattr(trace, "PARALLEL_BYTES", 0)
    assert trace._in_halves(path, None) is not None
    same_trace(trace.load(path), trace.load(DATA / "train_step.json.gz"))


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
@pytest.mark.parametrize("layout", ["object", "indented", "list", "compact"])
def test_a_trace_read_a_piece_at_a_time_is_the_trace_read_at_once(
    tmp_path, monkeypatch, layout, name
):
    path = write_generated(tmp_path / "t.json", 300, layout, python=True, gpu=True, threads=2)
    serial = trace.parse(path.read_bytes(), str(path))
    if name.endswith(".gz"):
        path = path.rename(tmp_path / name)
        path.write_bytes(gzip.compress(path.read_bytes()))
    monkeypatch.setattr(trace, "_PIECE", 10_000)
    monkeypatch.setattr(trace, "_WINDOW", 2_000)
    pieces = []
    monkeypatch.setattr(
        trace, "parse", lambda data, source, args_of: pieces.append(bytes(data)) or serial
    )
    trace.load(path)
    assert len(pieces) > path.stat().st_size // 20_000
    monkeypatch.undo()
    monkeypatch.setattr(trace, "_PIECE", 10_000)
    with trace._filler(path) as fill:
        same_trace(trace._streamed(fill, b"", b"", str(path)), serial)


def test_a_boundary_inside_args_is_passed_over(tmp_path, monkeypatch):
    events = [op(f"op{i}", BASE + i, 0.5, x=[{}, {"ph": i}], y="." * 500) for i in range(300)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": e.pop("ph"), **e} for e in events]}))
    whole = trace.parse(path.read_bytes(), str(path))
    monkeypatch.setattr(trace, "_PIECE", 1000)
    decoded = []
    parse = trace.parse
    monkeypatch.setattr(trace, "parse", lambda *a: decoded.append(len(a[0])) or parse(*a))
    with trace._filler(path) as read:
        same_trace(trace._streamed(read, b"", b"", str(path)), whole)
    assert len(decoded) > 100 and max(decoded) < 2 * 1000  # cut before the false boundaries


class Counted(gzip.GzipFile):
    opened = 0

    def __init__(self, *args, **kwargs):
        Counted.opened += 1
        super().__init__(*args, **kwargs)


@pytest.mark.parametrize("broken", [False, True])
def test_a_gzip_is_decompressed_once(tmp_path, monkeypatch, broken):
    events = [op(f"op{i}", BASE + i, 0.5, x=[{}, {"ph": i}], y="." * 500) for i in range(300)]
    data = json.dumps({"traceEvents": [{"ph": e.pop("ph"), **e} for e in events]}).encode()
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(data[:-5] if broken else data))
    monkeypatch.setattr(trace, "_PIECE", 1000)
    monkeypatch.setattr(gzip, "GzipFile", Counted)
    Counted.opened = 0
    if broken:
        with pytest.raises(MPGuideError, match="not valid JSON"):
            trace.load(path)
    else:
        same_trace(trace.load(path), trace.parse(data, str(path)))
    assert Counted.opened == 1


def test_errors_name_the_event_and_byte_of_the_whole_document(tmp_path, monkeypatch):
    events = [op(f"op{i}", BASE + i, 0.5, y="." * 100) for i in range(300)]
    events[250]["pid"] = {"not": "a pid"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    monkeypatch.setattr(trace, "_PIECE", 2000)
    with pytest.raises(MPGuideError, match=r"\$\.traceEvents\[250\]\.pid"):
        trace.load(path)
    events[250]["pid"] = 1
    data = json.dumps(events).encode()
    junk = data.index(b'"op280"')
    path.write_bytes(data[:junk] + b"?" + data[junk + 1 :])
    with pytest.raises(MPGuideError, match=rf"\(byte {junk}\)"):
        trace.load(path)


def test_a_trace_from_a_stream():
    data = json.dumps({"traceEvents": [op("a", BASE, 10.0), op("b", BASE + 1, 1.0)]}).encode()
    for raw in (data, gzip.compress(data)):
        tr = trace.load(io.BufferedReader(io.BytesIO(raw)))
        assert [e.name for e in tr.events] == ["a", "b"] and tr.source == "<stream>"


def test_leading_whitespace_and_a_utf8_byte_order_mark_are_read(tmp_path, monkeypatch):
    data = json.dumps([op("a", BASE, 10.0)]).encode()
    monkeypatch.setattr(trace, "_PIECE", 256)
    for framed in (b"\xef\xbb\xbf" + data, b" \n" * 100 + data, b"\xef\xbb\xbf\r\n" + data):
        (tmp_path / "t.json").write_bytes(framed)
        assert [e.name for e in trace.load(tmp_path / "t.json").events] == ["a"]
    (tmp_path / "t.json").write_bytes(b" " * 1000 + data)
    with pytest.raises(MPGuideError, match="whitespace"):
        trace.load(tmp_path / "t.json")


def test_the_size_cap(tmp_path):
    data = json.dumps([op("a", BASE, 10.0)] * 100).encode()
    for name, raw in (("t.json", data), ("t.json.gz", gzip.compress(data))):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(MPGuideError, match=r"more than 1 KiB.*max_bytes"):
            trace.load(tmp_path / name, max_bytes=1024)
        assert len(trace.load(tmp_path / name, max_bytes=len(data))) == 100
        assert len(trace.load(tmp_path / name, max_bytes=None)) == 100


def test_events_in_any_key_order_split(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "PARALLEL_BYTES", 0)
    events = [op(f"op{i}", BASE + i, 0.5) for i in range(2000)]
    name_first = tmp_path / "name_first.json"
    name_first.write_text(
        json.dumps({"traceEvents": [{"name": e.pop("name"), **e} for e in events]})
    )
    assert trace._in_halves(name_first, None) is not None
    assert len(trace.load(name_first)) == 2000
    broken = write_generated(tmp_path / "broken.json", 300, "object")
    broken.write_bytes(broken.read_bytes()[:-3])
    assert trace._in_halves(broken, None) is None
    with pytest.raises(MPGuideError, match="not valid JSON"):
        trace.load(broken)


def test_a_load_without_a_worker_decodes_in_one_piece(tmp_path, monkeypatch, caplog):
    path = write_generated(tmp_path / "t.json", 100, "object")
    monkeypatch.setattr(trace, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(halves.sys, "executable", str(tmp_path / "no-python"))
    assert trace._in_halves(path, None) is None
    assert "decoded in one piece: the worker failed: FileNotFoundError" in caplog.text
    same_trace(trace.load(path), trace.parse(path.read_bytes(), str(path)))


def test_a_worker_that_crashes_says_why(tmp_path, monkeypatch, caplog):
    path = write_generated(tmp_path / "t.json", 100, "object")
    monkeypatch.setattr(trace, "_WORKER", "raise SystemExit('worker gave up')")
    assert trace._in_halves(path, None) is None
    assert "decoded in one piece: the worker exited 1: worker gave up" in caplog.text


def test_events_are_a_sequence():
    tr = trace.parse(json.dumps([op("a", BASE, 1.0), op("b", BASE + 2, 1.0, tid=2)]).encode())
    assert len(tr.events) == 2 and tr.events[-1].name == "b" and tr.events[-1].tid == 2
    assert [e.name for e in tr.events[::-1]] == ["b", "a"]
    assert msgspec.json.decode(tr.events[0].args) == {}
    with pytest.raises(IndexError):
        tr.events[2]


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(MPGuideError, match="no such file"):
        trace.load(tmp_path / "absent.json")
    with pytest.raises(MPGuideError, match="is a directory"):
        trace.load(tmp_path)


def test_bytes_that_are_not_utf8_are_replaced_and_counted(tmp_path):
    good = json.dumps({"traceEvents": [op("py(1): f", BASE, 10.0, cat="python_function")]})
    bad = good.encode().replace(b"py(1)", b"py\xff\xfe(1)").replace(b"{}", b'{"x": "\xc3"}')
    for name, data in (("t.json", bad), ("t.json.gz", gzip.compress(bad))):
        (tmp_path / name).write_bytes(data)
        tr = trace.load(tmp_path / name)
        assert tr.replaced == 3 and tr.events[0].name == "py\ufffd\ufffd(1): f"
        tree = tr.tree(python=False)
        assert tree.anomalies.replaced == 3 and tree.hidden == {"python_function": 1}
        assert tr.tree(python=True).node(0).args == {"x": "\ufffd"}
    assert trace.parse(good.replace("py(1)", "py\ufffd(1)").encode()).replaced == 0


def test_events_without_times_are_counted_and_left_out():
    timed = op("a", BASE, 10.0)
    no_dur = {k: v for k, v in op("b", BASE + 1, 1.0).items() if k != "dur"}
    no_ts = {k: v for k, v in op("c", BASE + 2, 1.0).items() if k != "ts"}
    tree = tree_of(timed, no_dur, no_ts, op("d", BASE + 3, 1.0))
    assert tree.anomalies.no_time == 2 and tree.anomalies.total() == 2
    assert [n.name for n in tree.find()] == ["a", "d"] and tree.node(3).parent.name == "a"
    assert len(tree) == 2 and "no time 2" in repr(tree)
    with pytest.raises(MPGuideError, match="no node with id 1"):
        tree.node(1)


# Finding and rendering


def test_find_by_name_id_and_predicate():
    tree = tree_of(
        op("aten::mm", BASE, 10.0),
        op("aten::add", BASE + 20, 10.0),
        op("aten::mm", BASE + 40, 30.0),
    )
    assert [n.id for n in tree.find("aten::mm")] == [0, 2]
    assert tree.find(id=1)[0].name == "aten::add"
    assert [n.id for n in tree.find("aten::mm", predicate=lambda n: n.dur > 20)] == [2]
    with pytest.raises(MPGuideError, match="no node with id 9"):
        tree.node(9)


def test_find_honours_every_criterion_given():
    tree = tree_of(
        op("aten::mm", BASE, 10.0),
        op("aten::add", BASE + 20, 10.0),
        op("aten::mm", BASE + 40, 30.0),
    )

    def long(node):
        return node.dur > 20

    assert [n.id for n in tree.find(id=1)] == [1]
    assert tree.find("aten::mm", id=1) == []
    assert [n.id for n in tree.find("aten::mm", id=2)] == [2]
    assert tree.find(id=0, predicate=long) == []
    assert [n.id for n in tree.find(id=2, predicate=long)] == [2]
    assert tree.find("aten::add", predicate=long) == []
    assert [n.id for n in tree.find("aten::mm", id=2, predicate=long)] == [2]
    assert tree.find("aten::mm", id=0, predicate=long) == []
    with pytest.raises(MPGuideError, match="no node with id 9"):
        tree.find("aten::mm", id=9)


def test_render_fields_and_depth():
    dims = [[2048, 1024], [1024, 4096]]
    tree = tree_of(
        op(
            "aten::matmul",
            BASE,
            10.0,
            **{"Input Dims": dims, "Input type": ["c10::BFloat16", "float"]},
        ),
        op("aten::to", BASE + 1, 2.0),
        op("aten::_to_copy", BASE + 1.5, 1.0),
    )
    text = tree.render(depth=1)
    assert (
        "└── aten::matmul  10.0 µs  Input Dims: [[2048, 1024], [1024, 4096]]  "
        "Input type: ['c10::BFloat16', 'float']"
    ) in text
    assert "    └── aten::to  2.0 µs" in text and "_to_copy" not in text
    assert "Input Dims" not in tree.render(fields=["Input type"])
    html = tree.html(tree.node(0))
    assert html.startswith('<pre class="mpguide-tree">') and "&#x27;float&#x27;" in html


@pytest.mark.parametrize(
    ("us", "text"),
    [(0.25, "250 ns"), (12.34, "12.3 µs"), (999.0, "999.0 µs"), (4560.0, "4.56 ms"),
     (1.2e6, "1.20 s"), (1.234e9, "1,234 s"), (math.nan, "? µs"), (None, None)],
)  # fmt: skip
def test_durations_read_in_units(us, text):
    assert units.duration_text(us) == text


def test_indentation_is_bounded_and_chains_collapse():
    # 40 events each inside the previous, then a node with two children at the bottom
    chain = [op("a", BASE + k, 200.0 - 2 * k) for k in range(40)]
    tree = tree_of(*chain, op("b", BASE + 41, 1.0), op("c", BASE + 43, 1.0))
    drawn = calltree.Drawn()
    lines = list(tree.lines(fields=[], drawn=drawn))
    assert lines[1].startswith("└── a") and lines[2] == "    └── a  198.0 µs"
    assert lines[3] == "        ├── ... 37 nested nodes of one child each"
    assert lines[4] == "        └── a  122.0 µs"  # the last of the chain, whose children follow
    assert lines[5:] == ["            ├── b  1.0 µs", "            └── c  1.0 µs"]
    assert (drawn.nodes, drawn.chained) == (5, 37) and tree.count() == 42
    # without chains (two children each level) the indentation stops at INDENT levels
    wide = [op("a", BASE + 2 * k, 400.0 - 4 * k) for k in range(40)]
    leaves = [op("x", BASE + 2 * k + 1, 0.5) for k in range(40)]
    deep = tree_of(*wide, *leaves)
    widths = [len(line) for line in deep.lines(fields=[])]
    assert max(widths) < 4 * calltree.INDENT + 22
    assert any(line.startswith("[+24] ") for line in deep.lines(fields=[]))
    assert deep.count() == 80 == sum(1 for line in deep.lines(fields=[]) if "── " in line)


# Properties: no event is ever dropped


events_strategy = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.integers(0, 50),
        st.integers(0, 30),
        st.sampled_from(["cpu_op", "python_function", "user_annotation", "kernel", "cuda_runtime"]),
        st.integers(0, 4),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(events_strategy)
def test_any_trace_keeps_every_event_exactly_once(raw):
    events = []
    for tid, start, dur, cat, corr in raw:
        args = {"correlation": corr} if cat in ("kernel", "cuda_runtime") else {}
        events.append(op(f"e{len(events)}", BASE + start / 8, dur / 4, cat=cat, tid=tid, **args))
    tree = tree_of(*events)
    assert placed_once(tree)
    for i in range(len(events)):
        depth, node = 0, tree.node(i)
        while node.parent is not None:
            node, depth = node.parent, depth + 1
            assert depth <= len(events)
        assert depth == tree.depth[i]


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 300), st.booleans(), st.booleans(), st.integers(1, 3), st.integers(0, 9))
def test_generated_traces_nest_as_generated(ops, python, gpu, threads, seed):
    generated = list(
        tracegen.generate(
            ops, python=python, gpu=gpu, threads=threads, layers_per_step=1, seed=seed
        )
    )
    doc = {"traceEvents": [tracegen._json(e) for e in generated]}
    tree = trace.parse(json.dumps(doc).encode()).tree(python=True)
    nodes = [k for k, e in enumerate(generated) if e["ph"] == "X"]
    assert len(tree) == len(nodes)
    assert placed_once(tree)
    assert tree.anomalies.total() == 0
    node_of = {k: i for i, k in enumerate(nodes)}
    for k in nodes:
        want = generated[k]["parent"]
        assert tree.parent[node_of[k]] == (node_of[want] if want >= 0 else -1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), max_size=40))
def test_array_nesting_is_the_stack_nesting(spans):
    spans = sorted(spans, key=lambda span: (span[0], -span[1]))
    start = np.array([s for s, _ in spans], dtype=np.int64)
    end = start + np.array([d for _, d in spans], dtype=np.int64)
    parents, depths, seen = nesting._nest_in_stack(start.tolist(), end.tolist())
    found = nesting._nest_without_overlaps(start, end)
    if found is None:
        assert seen["overlaps"] > 0
        return
    parent, depth, counts = found
    assert parent.tolist() == parents and depth.tolist() == depths
    assert [counts[k] for k in ("touching", "identical")] == [seen["touching"], seen["identical"]]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1), st.integers(0, 20), st.integers(0, 6)), max_size=50),
    st.integers(1, 7),
)
def test_nesting_a_chunk_at_a_time_is_the_stack_nesting(spans, chunk):
    """The tree nests each thread a chunk at a time (item 1 of issue 42: memory); with
    chunks of a few events it nests as one stack over the whole thread does."""
    events = [op(f"e{k}", BASE + s, d, tid=t) for k, (t, s, d) in enumerate(spans)]
    whole = tree_of(*events)
    original = nesting._CHUNK
    nesting._CHUNK = chunk
    try:
        chunked = tree_of(*events)
    finally:
        nesting._CHUNK = original
    assert chunked.parent.tolist() == whole.parent.tolist()
    assert chunked.depth.tolist() == whole.depth.tolist()
    assert chunked.order.tolist() == whole.order.tolist()
    assert chunked.anomalies == whole.anomalies
    seen = Counter()
    for t in (0, 1):  # and as one stack nests each thread's events, sorted
        ids = [k for k, s in enumerate(spans) if s[0] == t]
        ids.sort(key=lambda k: (spans[k][1], -spans[k][2]))
        start = [spans[k][1] for k in ids]
        end = [spans[k][1] + spans[k][2] for k in ids]
        parents, depths, counts = nesting._nest_in_stack(start, end)
        seen += counts
        assert [chunked.parent[k] for k in ids] == [ids[p] if p >= 0 else -1 for p in parents]
        assert [chunked.depth[k] for k in ids] == depths
    for key in ("overlaps", "touching", "identical"):
        assert getattr(chunked.anomalies, key) == seen[key]


def test_args_are_kept_as_written_and_none_is_not_stored():
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
        {"ph": "X", "name": "none", "ts": 1, "dur": 1},
        {"ph": "X", "name": "empty", "ts": 2, "dur": 1, "args": {}},
        {"ph": "X", "name": "list", "ts": 3, "dur": 1, "args": []},
        {"ph": "X", "name": "one", "ts": 4, "dur": 1, "args": {"a": 1}},
    ]
    loaded = trace.parse(json.dumps({"traceEvents": events}, separators=(",", ":")).encode())
    assert [e.name for e in loaded.events] == ["none", "empty", "list", "one"]
    assert loaded.other == {"M": 1}
    assert loaded.args.raws(np.arange(4)) == [b"{}", b"{}", b"[]", b'{"a":1}']
    assert loaded.args.stored.tolist() == [1, 2, 3]
    only = trace.parse(json.dumps({"traceEvents": events}).encode(), args_of="one".__eq__)
    assert only.args.raws(np.array([3])) == [b'{"a": 1}'] and only.args.stored.tolist() == [3]
