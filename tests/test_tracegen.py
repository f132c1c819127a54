import gzip
import json

from mpguide.traces import trace, tracegen


def test_write_plain_and_gzip(tmp_path):
    for name in ("g.json", "g.json.gz"):
        path = tracegen.write(tmp_path / name, 100, python=True, gpu=True, threads=2)
        raw = path.read_bytes()
        doc = json.loads(gzip.decompress(raw) if name.endswith(".gz") else raw)
        cats = {e.get("cat") for e in doc["traceEvents"]}
        assert {"cpu_op", "python_function", "kernel", "cuda_runtime", "ac2g"} <= cats
        assert len({e["tid"] for e in doc["traceEvents"] if e.get("cat") == "cpu_op"}) == 2


def test_asked_number_of_ops_in_whole_layers():
    events = list(tracegen.generate(1000))
    ops = sum(e.get("cat") == "cpu_op" for e in events)
    assert 1000 <= ops < 1000 + tracegen._LAYER_OPS


def test_generated_timestamps_keep_nanoseconds(tmp_path):
    path = tracegen.write(tmp_path / "g.json", 50)
    tree = trace.load(path).tree()
    assert tree.anomalies.total() == 0
    assert all(len(repr(e.ts).split(".")[-1]) <= 3 for e in trace.load(path).events)


def test_a_rank_has_its_own_processes_clock_and_correlation_ids():
    plain = list(tracegen.generate(100, gpu=True))
    rank = list(tracegen.generate(100, gpu=True, pid=20, gpu_pid=3, correlation=50, offset_ns=7))
    assert [e["ts"] - 7 for e in rank] == [e["ts"] for e in plain]
    kernels = [e for e in rank if e["cat"] == "kernel"]
    assert {e["pid"] for e in kernels} == {3}
    assert {e["pid"] for e in rank if e["cat"] == "cpu_op"} == {20}
    assert min(e["args"]["correlation"] for e in kernels) == 51
