"""The command line on hostile and broken input: exit 0 with valid output, or exit status 2
with one line on stderr; bounded memory and time; nothing left running or on disk.

Commands that could take much memory run in a child process whose address space is capped
(``RLIMIT_AS``): had a read gone past the cap, the child would have said "out of memory"
instead of the line each test expects.
"""

import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from mpguide.cli import main
from mpguide.traces import tracegen

MiB = 1 << 20
TINY = b'{"ph":"X","name":"a","ts":1,"dur":1},'
"""One small complete event and its comma."""
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""Characters that move a terminal's cursor, set its title or colours, or reorder text: all
but the newline that ends each line."""

# Runs ``python -m mpguide ARGS`` with its address space capped at argv[1] MiB.
_CAPPED = """
import resource, runpy, sys
limit = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["mpguide", *sys.argv[2:]]
runpy.run_module("mpguide", run_name="__main__", alter_sys=True)
"""


def capped(tmp_path: Path, *args: str, mem_mb: int = 512, **kw) -> subprocess.CompletedProcess:
    """``python -m mpguide ARGS`` in at most ``mem_mb`` MiB of address space, with an empty
    temporary folder of its own (``tmp_path / "tmp"``); ``.seconds`` is how long it ran."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), "OPENBLAS_NUM_THREADS": "1"}
    kw.setdefault("stdout", subprocess.PIPE)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CAPPED, str(mem_mb), *args],
        stderr=subprocess.PIPE,
        env=env,
        timeout=120,
        check=False,
        **kw,
    )
    proc.seconds = time.monotonic() - start
    assert list(tmp.iterdir()) == []
    return proc


def refused(proc: subprocess.CompletedProcess, *words: str) -> str:
    """The one line of a process that exited 2 saying ``words``."""
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2, err[-3000:]
    assert err.startswith("mpguide: error: ") and err.count("\n") == 1, err[-3000:]
    assert not proc.stdout
    for word in words:
        assert word in err
    return err


def one_line(capsys, *words: str) -> str:
    """The one line on stderr of a :func:`main` that returned 2, saying ``words``."""
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("mpguide: error: ") and captured.err.count("\n") == 1
    assert not CONTROL.search(captured.err)
    for word in words:
        assert word in captured.err, captured.err
    return captured.err


def gzip_members(*parts: tuple[bytes, int]) -> bytes:
    """A gzip file of ``(data, times)`` parts: ``data`` compressed once and its member repeated
    ``times``, so that a file of kilobytes decompresses to gigabytes in no time."""
    return b"".join(gzip.compress(data, mtime=0) * times for data, times in parts)


def op(name, ts, dur, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def write_trace(path: Path, *events) -> str:
    path.write_text(json.dumps({"traceEvents": list(events)}))
    return str(path)


# Compression bombs and unbounded buffers


def test_a_gzip_of_blanks_is_refused_without_reading_it_all(tmp_path):
    bomb = tmp_path / "blank.json.gz"
    bomb.write_bytes(gzip_members((b" " * (16 * MiB), 128)))  # 2 GiB of blanks
    assert bomb.stat().st_size < 4 * MiB
    proc = capped(tmp_path, "tree", str(bomb))
    refused(proc, "whitespace")
    assert proc.seconds < 30


def test_a_gzip_of_nul_bytes_is_refused_at_its_first_byte(tmp_path):
    bomb = tmp_path / "nul.json.gz"
    bomb.write_bytes(gzip_members((bytes(16 * MiB), 64)))  # 1 GiB of NUL
    proc = capped(tmp_path, "casts", str(bomb))
    refused(proc, r"starts with b'\x00")
    assert proc.seconds < 30


def test_the_decompressed_size_is_capped_and_the_cap_can_be_raised(tmp_path):
    events = TINY * (MiB // len(TINY))
    bomb = tmp_path / "tiny.json.gz"
    bomb.write_bytes(gzip_members((b"[", 1), (events, 256), (b'{"ph":"X"}]', 1)))  # 256 MiB
    refused(capped(tmp_path, "casts", str(bomb), "--max-bytes", "16M"), "16 MiB", "--max-bytes")
    small = tmp_path / "small.json.gz"
    small.write_bytes(gzip_members((b"[", 1), (events, 6), (b'{"ph":"X"}]', 1)))  # 6 MiB
    refused(capped(tmp_path, "tree", str(small), "--max-bytes", "4M"), "4 MiB")
    raised = capped(tmp_path, "casts", str(small), "--max-bytes", "8M", "--by", "cause")
    assert raised.returncode == 0, raised.stderr.decode()[-3000:]


def test_a_plain_file_over_the_default_cap_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that take no disk
    proc = capped(tmp_path, "tree", str(big))
    refused(proc, "2 GiB", "--max-bytes")
    assert proc.seconds < 30


@pytest.mark.parametrize("filler", [b" ", b"a"])
def test_the_read_buffer_is_bounded_when_no_event_boundary_comes(tmp_path, filler):
    bomb = tmp_path / "open.json.gz"
    start = b'{"traceEvents": [{"ph": "X", "args": {"s": "' if filler == b"a" else b"["
    bomb.write_bytes(gzip_members((start, 1), (filler * (16 * MiB), 64), (b'"}}]}', 1)))
    refused(capped(tmp_path, "casts", str(bomb)), "no event boundary")


def test_running_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    # Events with args, so that memory runs out in numpy or a bytes object: msgspec 0.22
    # crashes when an allocation fails while it decodes many small structs.
    event = b'{"ph":"X","name":"a","ts":1,"dur":1,"args":{"s":"%s"}},' % (b"x" * 350)
    path = tmp_path / "fat.json"
    path.write_bytes(b"[" + event * (60 * MiB // len(event)) + b'{"ph":"X"}]')
    refused(capped(tmp_path, "tree", str(path), "--limit", "1", mem_mb=170), "out of memory")
    small = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0))

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr("mpguide.traces.calltree.build", exhausted)
    assert main(["casts", small]) == 2
    one_line(capsys, "out of memory")


def test_bad_cap_values_are_one_line(tmp_path, capsys):
    path = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0))
    for value in ("12Q", "-1M", "M", "1e3"):
        assert main(["tree", path, "--max-bytes", value]) == 2
        one_line(capsys, "--max-bytes")


# Deep nesting


@pytest.mark.parametrize("nest", ["list", "object"])
def test_deep_nesting_is_one_line(tmp_path, capsys, nest):
    # As deep as the interpreter's recursion limit: 1000 in a fresh process, 2000 once
    # torch.compile has run in it (inductor raises it for the rest of the process).
    n = sys.getrecursionlimit()
    deep = "[" * n + "]" * n if nest == "list" else '{"a":' * n + "1" + "}" * n
    path = tmp_path / "deep.json"
    event = '{"ph": "X", "ts": 1, "dur": 1, "args": {"x": ' + deep + "}}"
    path.write_text('{"traceEvents": [' + event + "]}")
    for command in ("tree", "casts"):
        assert main([command, str(path)]) == 2
        one_line(capsys, "nested too deeply")


def test_a_tree_too_deep_for_json_is_one_line(tmp_path, capsys):
    path = write_trace(tmp_path / "chain.json", *[op("a", 1.0, 1.0)] * 1500)  # nest in a chain
    assert main(["tree", path, "--format", "json"]) == 2
    one_line(capsys, "--depth")
    assert main(["tree", path, "--format", "json", "--depth", "50"]) == 0
    assert json.loads(capsys.readouterr().out)["shown"] == 51


# Strict JSON


def test_json_output_is_strict(tmp_path, capsys):
    cast = {"Input type": ["c10::BFloat16", "float"]}
    huge = {**cast, "Input Dims": [[2**62] * 17, []]}  # more elements than a float can count
    path = write_trace(
        tmp_path / "t.json",
        op("aten::copy_", 1.0, 1.0, **huge),
        op("aten::copy_", 3.0, 1.0, **huge),
    )

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    for by in ("cast", "cause", "pair"):
        assert main(["casts", path, "--format", "json", "--by", by]) == 0
        rows = json.loads(capsys.readouterr().out, parse_constant=refuse)["rows"]
        if by == "cast":
            assert [(r["shape"], r["bytes read"]) for r in rows] == [(None, None)] * 2
        else:
            assert [r["casts"] for r in rows] == [2]


def test_a_model_whose_fp16_outputs_overflow_gives_strict_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "overflowing.py").write_text(
        "import torch\n\n\ndef make():\n"
        "    model = torch.nn.Linear(4, 3)\n"
        "    torch.nn.init.constant_(model.weight, 3e4)\n"
        "    return model, torch.ones(2, 4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["inference", "--model", "overflowing:make", "--variants", "fp32,fp16"]
    assert main([*argv, "--warmup", "0", "--repeat", "1", "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert "Infinity" not in out and "NaN" not in out
    rows = json.loads(out)["rows"]
    assert any(v is None for row in rows for v in row.values())


# Processes and files left behind

_HELD = """
import sys
import interruptible
from mpguide import cli
from mpguide.traces import casts, trace
trace.PARALLEL_BYTES = 0
casts.needs_args = interruptible.needs_args
sys.exit(cli.main(sys.argv[1:]))
"""

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition, seconds: float = 15.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def held(tmp_path):
    """``casts`` of a trace decoded in two processes, both held mid-read: the command's
    process, its worker's pid and the command's temporary folder. Whatever is left running
    afterwards is killed."""
    path = tracegen.write(tmp_path / "t.json", 200)
    marks, tmp = tmp_path / "marks", tmp_path / "tmp"
    marks.mkdir()
    tmp.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "TMPDIR": str(tmp),
        "MPGUIDE_TEST_MARKS": str(marks),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD, "casts", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        both = wait_until(lambda: len(list(marks.iterdir())) == 2 or proc.poll() is not None, 60)
        assert both and proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        (worker,) = {int(p.name) for p in marks.iterdir()} - {proc.pid}
        yield proc, worker, tmp
    finally:
        for pid in [proc.pid, *(int(p.name) for p in marks.iterdir())]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


@needs_proc
@pytest.mark.parametrize(
    ("sig", "status", "word"),
    [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")],
)
def test_a_signal_mid_decode_ends_both_processes_and_leaves_nothing(
    ctrl_c_heard, held, sig, status, word
):
    proc, worker, tmp = held
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C in a terminal signals the whole process group
    else:
        os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    err = err.decode(errors="replace")
    assert proc.returncode == status, err[-3000:]
    assert err.count("\n") == 1 and word in err, err[-3000:]
    assert wait_until(lambda: not alive(worker))
    assert list(tmp.iterdir()) == []


@needs_proc
def test_a_killed_command_leaves_no_worker_and_no_file(held):
    proc, worker, tmp = held
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert wait_until(lambda: not alive(worker))
    assert list(tmp.iterdir()) == []


# Terminal safety

HOSTILE = "aten::mm\x1b]0;owned\x07\x1b[2J\n└── forged\r\x9b31m\u202eevil"


def test_names_from_a_trace_cannot_drive_the_terminal(tmp_path, capsys):
    path = write_trace(
        tmp_path / "t.json",
        op(HOSTILE, 10.0, 5.0, **{"Input type": ["float\x1b[31m\u0085"]}),
        op("aten::copy_", 11.0, 1.0, **{"Input type": ["c10::BFloat16\n|x|", "float\x1b[0m"]}),
    )
    runs = {
        ("tree",): 4,  # the thread, two nodes, the anomalies
        # caption, header, rule, one row, three notes (ops as causes, blank bytes and share),
        # the first wrapped in two lines to fit 100 columns
        ("casts",): 8,
        ("casts", "--by", "cast"): 8,
        ("casts", "--format", "markdown"): 9,  # and a blank line after the caption and the row
    }
    for args, lines in runs.items():
        assert main([args[0], path, *args[1:]]) == 0
        out = capsys.readouterr().out
        assert not CONTROL.search(out), (args, out)
        assert out.count("\n") == lines, (args, out)
    assert main(["tree", path, "--op", HOSTILE]) == 0
    assert r"\x1b]0;owned\x07" in capsys.readouterr().out


def test_an_error_naming_a_hostile_path_is_one_line(tmp_path, capsys):
    path = tmp_path / "a\nb\x1b[2J.json"
    assert main(["tree", str(path)]) == 2
    one_line(capsys, "no such file")


# Smaller ones


def test_times_beyond_integer_nanoseconds_name_the_event(tmp_path, capsys):
    for event, field in ((op("late", 1e16, 1.0), "ts"), (op("long", 1.0, 1e16), "dur")):
        path = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0), event)
        assert main(["tree", path]) == 2
        one_line(capsys, f"event 1 ('{event['name']}')", field)


def test_a_negative_duration_names_the_event(tmp_path, capsys):
    path = write_trace(tmp_path / "t.json", op("a", 10.0, 5.0), op("aten::mm", 12.0, -1.0))
    assert main(["casts", path]) == 2
    one_line(capsys, "event 1 ('aten::mm')", "negative dur")


def test_input_types_that_are_not_strings_are_unknown(tmp_path, capsys):
    path = write_trace(
        tmp_path / "t.json",
        op("aten::copy_", 1.0, 1.0, **{"Input type": [[1], {"a": 1}]}),
        op("aten::copy_", 3.0, 1.0, **{"Input type": [5, "float"]}),
        op("aten::copy_", 5.0, 1.0, **{"Input type": ["c10::BFloat16", "float"]}),
    )
    assert main(["casts", path, "--by", "cast", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted((r["source"], r["target"]) for r in rows) == [
        ("float32", "?"),
        ("float32", "bfloat16"),
    ]


@pytest.fixture
def reader_file(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def same(x):\n    return x\n")
    return str(path)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("f32[8,,8]", ("bad input 'f32[8,,8]'",)),
        ("f32[,8]", ("bad input",)),
        ("f32[99999999999999999999]", ("f32[99999999999999999999]", "too large")),
        ("f32[4294967296,4294967296]", ("too large",)),
    ],
)
def test_bad_input_specs_are_one_line(reader_file, capsys, spec, words):
    assert main(["graph", f"{reader_file}:same", "--inputs", spec]) == 2
    one_line(capsys, *words)


def test_a_bad_autocast_dtype_names_the_option(reader_file, capsys):
    assert main(["graph", f"{reader_file}:same", "--inputs", "f32[8]", "--autocast", "int8"]) == 2
    err = one_line(capsys, "--autocast", "'int8'")
    assert "--unknown" not in err


def test_graph_help_says_the_file_is_imported(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["graph", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "running nothing" not in text and "top-level code runs" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "running nothing" not in capsys.readouterr().out


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_is_one_line(tmp_path):
    path = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0))
    with open("/dev/full", "wb") as full:
        proc = capped(tmp_path, "tree", path, stdout=full)
    refused(proc, "cannot write the output", "No space left on device")


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path, monkeypatch, capsys):
    path = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0))

    class Closed(io.StringIO):  # a pipe whose reader has gone, as after `| head`
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["tree", path]) == 141
    assert capsys.readouterr().err == ""


def test_a_symbolic_link_loop_is_named(tmp_path, capsys):
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    assert main(["tree", str(tmp_path / "a.json")]) == 2
    err = one_line(capsys, "symbolic link")
    assert "no such file" not in err


@pytest.mark.parametrize("compress", [False, True])
def test_a_trace_on_stdin(monkeypatch, capsys, compress):
    doc = json.dumps({"traceEvents": [op("aten::mm", 1.0, 2.0)]}).encode()
    data = gzip.compress(doc) if compress else doc
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))
    assert main(["tree", "-"]) == 0
    assert "aten::mm" in capsys.readouterr().out


def test_a_utf8_byte_order_mark_is_read_and_utf16_is_named(tmp_path, capsys):
    doc = json.dumps({"traceEvents": [op("aten::mm", 1.0, 2.0)]})
    path = tmp_path / "t.json"
    path.write_bytes(b"\xef\xbb\xbf" + doc.encode())
    assert main(["tree", str(path)]) == 0
    assert "aten::mm" in capsys.readouterr().out
    path.write_bytes(doc.encode("utf-16"))
    assert main(["tree", str(path)]) == 2
    one_line(capsys, "UTF-16")
