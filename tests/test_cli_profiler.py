import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import mpguide_process

from mpguide.cli import main
from mpguide.traces import tracegen

DATA = Path(__file__).parent / "data"
MATMUL = str(DATA / "autocast_matmul.json.gz")


def test_tree_of_an_op_with_fields_and_depth(capsys):
    assert (
        main(["tree", MATMUL, "--op", "aten::matmul", "--fields", "Input type", "--depth", "1"])
        == 0
    )
    out = capsys.readouterr().out
    duration = r"\d+(\.\d+)? (ns|µs|ms|s)"
    assert re.match(rf"└── aten::matmul  {duration}  Input type: \['c10::BFloat16', 'float'\]", out)
    assert re.search(rf"├── aten::to  {duration}  Input type: \['float',", out)
    assert "_to_copy" not in out and "Input Dims" not in out
    assert out.rstrip().splitlines()[-1] == "anomalies: none"


def test_tree_by_id(capsys):
    assert main(["tree", MATMUL, "--op", "aten::matmul"]) == 0
    assert main(["tree", MATMUL, "--id", "0", "--fields", ""]) == 0
    assert capsys.readouterr().out.count("ProfilerStep#") == 1


def test_tree_is_limited_and_says_what_it_left_out(tmp_path, capsys):
    path = tracegen.write(tmp_path / "t.json", 300)
    assert main(["tree", str(path), "--fields", "", "--limit", "0"]) == 0
    whole = capsys.readouterr().out.splitlines()
    assert main(["tree", str(path), "--fields", ""]) == 0  # 50 nodes by default
    lines = capsys.readouterr().out.splitlines()
    total = len(whole) - 2  # less the thread title and the anomalies
    assert lines[:51] == whole[:51]
    assert lines[-2] == f"... {total - 50:,} more nodes not shown (50 of {total:,}): " + (
        "--limit 0 shows all; --depth, --op or --id narrows"
    )
    assert main(["tree", str(path), "--limit", "7", "--fields", ""]) == 0
    assert capsys.readouterr().out.splitlines()[:8] == whole[:8]


def test_tree_as_json(tmp_path, capsys):
    assert main(["tree", MATMUL, "--op", "aten::matmul", "--depth", "1", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (matmul,) = [n for n in doc["nodes"] if n["fields"]["Input type"][1] == "float"]
    assert matmul["name"] == "aten::matmul" and matmul["dur"] > 0
    assert [c["name"] for c in matmul["children"]] == ["aten::to", "aten::matmul"]
    assert all(c["children"] == [] for c in matmul["children"])
    assert doc["shown"] == doc["total"] == 3 * len(doc["nodes"])
    assert doc["anomalies"]["overlaps"] == 0
    assert main(["tree", MATMUL, "--format", "json", "--limit", "5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["shown"] == 5 < doc["total"]


def test_undecodable_bytes_and_missing_times_are_counted(tmp_path, capsys):
    event = {"ph": "X", "cat": "python_function", "name": "a.py(1): f", "pid": 1, "tid": 1}
    doc = {"traceEvents": [{**event, "ts": 1.0, "dur": 2.0}, {**event, "ts": 2.0}]}
    path = tmp_path / "t.json"
    path.write_bytes(json.dumps(doc).encode().replace(b"a.py", b"a\xff.py"))
    assert main(["tree", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.endswith(
        "hidden: 2 python_function events (--python shows them)\nanomalies: replaced 2\n"
    )
    assert main(["casts", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("casts by cause") and captured.err == (
        "mpguide: note: 2 invalid UTF-8 sequences replaced by U+FFFD\n"
        "mpguide: note: 1 events without ts or dur left out\n"  # casts reads the Python layer
    )
    assert main(["tree", str(path), "--python"]) == 0
    assert "a\ufffd.py(1): f" in capsys.readouterr().out
    proc = mpguide_process("tree", str(path), "--python", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    anomalies = json.loads(proc.stdout)["anomalies"]
    assert anomalies["no_time"] == 1 and anomalies["replaced"] == 2


@pytest.mark.parametrize("fmt", ["table", "json", "csv"])
def test_casts_formats(capsys, fmt):
    assert main(["casts", MATMUL, "--by", "cast", "--format", fmt]) == 0
    out = capsys.readouterr().out
    assert "aten::matmul" in out
    assert ("f32->bf16" if fmt == "table" else "bfloat16") in out
    if fmt == "json":
        rows = json.loads(out)["rows"]
        assert {(r["source"], r["target"]) for r in rows} == {
            ("float32", "bfloat16"),
            ("bfloat16", "float32"),
        }


def test_casts_summary(capsys):
    assert main(["casts", MATMUL, "--by", "pair", "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("source,target,casts,")


GPU = DATA / "gpu"
H100_QWEN = str(GPU / "h100_qwen1.5-0.5b_bf16_inference.json.gz")
A100_STEP = str(GPU / "a100_torchrec_train_step.json.gz")
VLLM_GRAPH = str(GPU / "mi300x_vllm_decode_graph.json.gz")


def test_casts_defaults_to_the_summary_by_module_and_line(capsys):
    assert main(["casts", H100_QWEN]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "casts by cause" and lines[1].split() == [
        *("cause", "dtypes", "casts", "written"),
        *("CPU", "GPU", "CPU", "%", "GPU", "%"),
    ]
    rows = lines[3:5]  # the cause shortened from the middle to fit 100 columns
    assert rows[0].startswith("Qwen2RMSN...") and rows[0].split()[1:] == [
        *("bf16->f32,", "f32->bf16", "98", "2.69", "GB"),
        *("1.66", "ms", "2.33", "ms", "3.52%", "7.30%"),
    ]
    assert rows[0].split()[0].endswith("_qwen2.py:218)")
    assert rows[1].startswith("Qwen2Rota...") and "f32->bf16, i64->f32" in rows[1]
    # Its 22 cast kernels were launched before the trace began: kept apart, and said why.
    assert lines[5].startswith("22 more cast kernels (403.9 µs) were launched before the trace")
    assert not any("casts fused into kernels" in line for line in lines)
    assert main(["casts", H100_QWEN, "--format", "json"]) == 0
    first = json.loads(capsys.readouterr().out)["rows"][0]
    assert first["cause"] == "Qwen2RMSNorm (transformers/models/qwen2/modeling_qwen2.py:218)"
    assert (first["dtypes"], first["bytes written"]) == ("bf16->f32, f32->bf16", 2692644864)
    assert first["share of step"] == 0.03519 and first["gpu share of step"] == 0.07303
    assert main(["casts", H100_QWEN, "--by", "module", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["module"], r["casts"]) for r in rows] == [
        ("Qwen2RMSNorm", 98),
        ("Qwen2RotaryEmbedding", 3),
    ]


def test_casts_are_limited_and_say_what_they_left_out(capsys):
    assert main(["casts", H100_QWEN, "--by", "cast", "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"101 casts in {H100_QWEN}" and len(lines) == 3 + 3 + 3  # a note wraps
    assert lines[6] == "... 98 more rows not shown (3 of 101)"
    assert main(["casts", H100_QWEN, "--by", "cast", "--limit", "0", "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["rows"]) == 101
    assert main(["casts", H100_QWEN, "--by", "cast", "--format", "csv"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1 + 25
    assert captured.err.splitlines()[0] == "mpguide: note: ... 76 more rows not shown (25 of 101)"


def test_a_large_trace_prints_a_short_summary_by_default(tmp_path, capsys):
    path = tracegen.write(tmp_path / "t.json", 3000, gpu=True)
    assert main(["casts", str(path)]) == 0
    assert len(capsys.readouterr().out.splitlines()) < 10
    assert main(["casts", str(path), "--by", "cast"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3 + 25].startswith("... ")  # the notes after it wrap to fit


def test_a_json_array_of_records_is_refused(tmp_path, capsys):
    records = tmp_path / "records.json"
    records.write_text(json.dumps([{"name": "loss", "value": 1.5}, {"name": "lr", "value": 2}]))
    assert main(["casts", str(records)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a chrome trace: its 2 objects have no phase" in err


def test_scalar_casts_are_folded_unless_asked_for(capsys):
    assert main(["casts", A100_STEP, "--by", "cast", "--limit", "0"]) == 0
    folded = capsys.readouterr().out.splitlines()
    assert "(0-d casts: 1, folded)" in folded[-3]  # the note under it wraps to two lines
    assert main(["casts", A100_STEP, "--by", "cast", "--limit", "0", "--scalars"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == len(folded) and not any("folded" in line for line in shown)
    assert sum("  forward  " in line for line in shown) == 18


def test_fused_casts_on_their_own(capsys):
    assert main(["casts", VLLM_GRAPH]) == 0
    out = capsys.readouterr().out
    assert "23 casts fused into kernels (292.4 µs of kernel time)" in out
    assert "share of step is blank: the trace has no ProfilerStep#N range" in out
    assert main(["casts", VLLM_GRAPH, "--by", "fused", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert (row["kernel"], row["kind"], row["kernels"]) == (
        "triton_poi_fused__to_copy_1",
        "compiled",
        23,
    )


def one_event(**fields):
    event = {"ph": "X", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0, **fields}
    return json.dumps({"traceEvents": [event]}).encode()


LAUNCH_ARGS_LIST = one_event(cat="cuda_runtime", name="cudaLaunchKernel", args=[1])
CAST_ARGS_LIST = one_event(cat="cpu_op", name="aten::to", args=[1])


@pytest.mark.parametrize(
    ("argv", "content", "message"),
    [
        (["casts"], None, "no such file"),
        (["tree"], None, "no such file"),
        (["casts"], None, "no traces in it"),
        (["casts"], b'{"traceEvents": [', "not valid JSON"),
        (["tree"], b"<html>", "not valid JSON"),
        (["casts"], b'{"a": 1}', "not a chrome trace"),
        (["tree", "--id", "999"], b'{"traceEvents": []}', "no node with id 999"),
        (["tree", "--op", "aten::nope"], b'{"traceEvents": []}', "no op named 'aten::nope'"),
        (["tree", "--depth", "-1"], b'{"traceEvents": []}', "--depth must be 0 or more"),
        (["tree", "--limit", "-1"], b'{"traceEvents": []}', "--limit must be 0"),
        (["tree"], LAUNCH_ARGS_LIST, "a launch's or GPU event's args are not usable"),
        (["casts"], CAST_ARGS_LIST, "a cast op's args are not usable"),
        (["tree", "--format", "html"], b'{"traceEvents": []}', "invalid choice: 'html'"),
        (["casts", "--format", "xml"], b'{"traceEvents": []}', "invalid choice: 'xml'"),
        (["casts", "--limit", "-2"], b'{"traceEvents": []}', "--limit must be 0"),
        (["casts", "--by", "op"], b'{"traceEvents": []}', "invalid choice: 'op'"),
    ],
)
def test_bad_input_gives_one_line_and_status_2(tmp_path, capsys, argv, content, message):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_bytes(content)
    if message == "no traces in it":
        path.mkdir()
    assert main([argv[0], str(path), *argv[1:]]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err


@pytest.mark.slow
def test_casts_as_a_process_without_torch(tmp_path):
    code = (
        "import sys; from mpguide.cli import main; rc = main(['casts', sys.argv[1]]); "
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, MATMUL], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "aten::matmul" in proc.stdout
    bad = mpguide_process("casts", str(tmp_path / "x.json"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("mpguide: error: ")
