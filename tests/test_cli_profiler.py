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
    assert captured.out == "no casts in this trace\n" and captured.err == (
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
    # At 100 columns the causes do not fit beside the figures: each has a line of its own,
    # whole, and the figures follow it, indented.
    assert lines[:2] == ["casts by cause", "cause"] and lines[2].split() == [
        *("dtypes", "casts", "written"),
        *("CPU", "GPU", "CPU", "%", "GPU", "%"),
    ]
    assert lines[4] == "Qwen2RMSNorm (transformers/models/qwen2/modeling_qwen2.py:218)"
    assert lines[5].startswith("    bf16->f32, f32->bf16") and lines[5].split()[2:] == [
        *("98", "2.69", "GB"),
        *("1.66", "ms", "2.33", "ms", "3.52%", "7.30%"),
    ]
    assert lines[6] == "Qwen2RotaryEmbedding (transformers/models/qwen2/modeling_qwen2.py:323)"
    assert "f32->bf16, i64->f32" in lines[7]
    assert all(len(line) <= 100 for line in lines)
    # Its 22 cast kernels were launched before the trace began: kept apart, and said why.
    assert lines[8].startswith("22 more cast kernels (403.9 µs) were launched before the trace")
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
    # caption, "cause", header, rule, 3 x (cause, figures), the limit's note, a wrapped note
    assert lines[0] == f"101 casts in {H100_QWEN}" and len(lines) == 4 + 2 * 3 + 1 + 2
    assert lines[10] == "... 98 more rows not shown (3 of 101)"
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
    # The causes on lines of their own; the note under them wraps to two lines.
    assert folded[-4] == "(0-d casts: 1, folded)" and "4 B" in folded[-3]
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


TRACES = sorted((DATA / "gpu").glob("*.json.gz")) + sorted((DATA / "ranks").glob("*.json.gz"))


@pytest.mark.parametrize("by", ["cause", "cast", "fused"])
@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_every_cause_is_whole_at_100_columns(capsys, path, by):
    """On every committed trace, each cause the JSON gives is printed whole by the text
    output, and no line passes 100 columns."""
    assert main(["casts", str(path), "--by", by, "--format", "json"]) == 0
    causes = {r["cause"] for r in json.loads(capsys.readouterr().out)["rows"]}
    assert main(["casts", str(path), "--by", by]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 100 for line in lines)
    assert all(any(cause in line for line in lines) for cause in causes)


def test_a_cause_longer_than_a_line_wraps_and_a_narrow_terminal_never_cuts_it(
    tmp_path, capsys, monkeypatch
):
    module = "nn.Module: " + "VeryLongModuleName" * 4 + "_0"
    frame = "models/" + "deep/" * 12 + "net.py(12): forward"
    events = [
        {
            "ph": "X",
            "cat": "python_function",
            "name": module,
            "pid": 1,
            "tid": 1,
            "ts": 1.0,
            "dur": 100.0,
        },
        {
            "ph": "X",
            "cat": "python_function",
            "name": frame,
            "pid": 1,
            "tid": 1,
            "ts": 2.0,
            "dur": 90.0,
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::to",
            "pid": 1,
            "tid": 1,
            "ts": 5.0,
            "dur": 10.0,
            "args": {
                "Input type": ["float", "Scalar"],
                "Input Dims": [[8], []],
                "Concrete Inputs": ["", "15"],
            },
        },
    ]
    path = tmp_path / "long.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert main(["casts", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    cause = f"{'VeryLongModuleName' * 4} ({frame.split('(')[0]}:12)"
    assert len(cause) > 100 and all(len(line) <= 100 for line in lines)
    at = lines.index("cause") + 3
    assert " ".join(x.strip() for x in lines[at : at + 2]) == cause  # wrapped, not cut
    monkeypatch.setenv("COLUMNS", "40")
    assert main(["casts", H100_QWEN, "--by", "fused"]) == 0
    out = capsys.readouterr().out
    assert "\n(launch not in the trace)\n" in out and "launch..." not in out


def test_fused_view_agrees_with_the_default_on_kernels_launched_before_the_trace(capsys):
    assert main(["casts", H100_QWEN]) == 0
    default = capsys.readouterr().out
    assert main(["casts", H100_QWEN, "--by", "fused"]) == 0
    fused = capsys.readouterr().out
    said = "22 more cast kernels (403.9 µs) were launched before the trace began"
    assert said in default.replace("\n  ", " ") and said in fused.replace("\n  ", " ")
    assert "not fused casts, not counted" in fused.replace("\n  ", " ")
    assert fused.startswith("no fused cast kernels launched in the trace\n")


@pytest.mark.parametrize(
    ("path", "by", "first"),
    [
        (DATA / "gpu" / "a100_alexnet_no_shapes.json.gz", "cause", "no casts in this trace"),
        (
            DATA / "gpu" / "b200_vllm_gpt-oss_eager_window.json.gz",
            "cause",
            "no cast ops in this trace",
        ),
        (DATA / "train_step.json.gz", "fused", "no fused cast kernels in this trace"),
    ],
)
def test_no_casts_is_one_line_then_the_notes(capsys, path, by, first):
    assert main(["casts", str(path), "--by", by]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == first and not any(line.startswith("---") for line in lines)


@pytest.mark.parametrize("command", ["casts", "tree"])
def test_a_directory_prints_units_and_percentages(capsys, command):
    """The rows per rank and the summary across ranks in ms, µs or s and %, as the report of
    one trace; JSON keeps microseconds and fractions."""
    ranks_dir = str(DATA / "ranks")
    assert main([command, ranks_dir, "--jobs", "1", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert main([command, ranks_dir, "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert not re.search(r"\de[+-]\d", out), out
    lines = out.splitlines()
    for row in doc["ranks"]["rows"]:
        (line,) = [x for x in lines if x.startswith(f"{row['rank']}  ")]
        if command == "casts":
            share = 100 * row["share of step"]
            assert f"{share:.2f}%" in line and ("µs" in line or "ms" in line)
            assert f"{row['events']:,}" in line
        else:
            assert f"{row['step us'] / 1e6:.2f} s" in line
            assert f"{row['gpu us'] / 1e3:.2f} ms" in line
    headline = lines[-1]
    assert headline.startswith(("most time in casts: rank ", "longest profiled steps: rank "))
    assert re.search(
        r"\(\w[\w ]* [\d.]+ (µs|ms|s), [\d.]+x the median of [\d.]+ (µs|ms|s)\)$", headline
    ), headline


def test_the_dtypes_are_cut_before_the_causes(capsys):
    """Rank 0's causes are short: cutting the dtypes to their first direction and a count
    keeps each row on one line with its cause whole, and a note says so."""
    assert main(["casts", str(DATA / "ranks" / "sampled_rank-0.json.gz")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:2] == ["cause", "dtypes"]
    (forward,) = [line for line in lines if line.startswith("forward ")]
    assert forward.split()[1:3] == ["b8->f32", "+2"]
    assert any(line.startswith("DistributedDataParallel.forward  i32->i64") for line in lines)
    assert lines[-1].startswith("dtypes: the row's most frequent direction, +N how many more")
    assert main(["casts", str(DATA / "ranks" / "sampled_rank-0.json.gz"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["cause"]: r["dtypes"] for r in rows}["forward"] == "b8->f32, i32->i64, f64->f32"
