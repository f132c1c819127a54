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
from helpers import ROOT

from mpguide.cli import main
from mpguide.traces import calltree, halves, trace, tracegen

MiB = 1 << 20
TINY = b'{"ph":"X","name":"a","ts":1,"dur":1},'
"""One small complete event and its comma."""
CONTROL = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]"
)
"""Characters that move a terminal's cursor, set its title or colours, reorder or hide text:
all but the newline that ends each line."""

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


@pytest.mark.slow
def test_a_gzip_of_blanks_is_refused_without_reading_it_all(tmp_path):
    bomb = tmp_path / "blank.json.gz"
    bomb.write_bytes(gzip_members((b" " * (16 * MiB), 128)))  # 2 GiB of blanks
    assert bomb.stat().st_size < 4 * MiB
    proc = capped(tmp_path, "tree", str(bomb))
    refused(proc, "whitespace")
    assert proc.seconds < 30


@pytest.mark.slow
def test_a_gzip_of_nul_bytes_is_refused_at_its_first_byte(tmp_path):
    bomb = tmp_path / "nul.json.gz"
    bomb.write_bytes(gzip_members((bytes(16 * MiB), 64)))  # 1 GiB of NUL
    proc = capped(tmp_path, "casts", str(bomb))
    refused(proc, r"starts with b'\x00")
    assert proc.seconds < 30


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_plain_file_over_the_default_cap_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB that take no disk
    proc = capped(tmp_path, "tree", str(big))
    refused(proc, "2 GiB", "--max-bytes")
    assert proc.seconds < 30


@pytest.mark.slow
@pytest.mark.parametrize("filler", [b" ", b"a"])
def test_the_read_buffer_is_bounded_when_no_event_boundary_comes(tmp_path, filler):
    bomb = tmp_path / "open.json.gz"
    start = b'{"traceEvents": [{"ph": "X", "args": {"s": "' if filler == b"a" else b"["
    bomb.write_bytes(gzip_members((start, 1), (filler * (16 * MiB), 64), (b'"}}]}', 1)))
    refused(capped(tmp_path, "casts", str(bomb)), "no event boundary")


@pytest.mark.slow
def test_running_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    # Events with args, so that memory runs out in numpy or a bytes object: msgspec 0.22
    # crashes when an allocation fails while it decodes many small structs.
    event = b'{"ph":"X","name":"a","ts":1,"dur":1,"args":{"s":"%s"}},' % (b"x" * 350)
    path = tmp_path / "fat.json"
    path.write_bytes(b"[" + event * (60 * MiB // len(event)) + b'{"ph":"X"}]')
    # refused by the estimate before the decode, or by MemoryError if the estimate is low
    refused(capped(tmp_path, "tree", str(path), "--limit", "1", mem_mb=170), "memory")
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
    assert main(["tree", path, "--format", "json", "--limit", "0"]) == 2
    one_line(capsys, "--depth")
    assert main(["tree", path, "--format", "json", "--depth", "50", "--limit", "0"]) == 0
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


@pytest.mark.slow
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


@pytest.mark.slow
@needs_proc
def test_a_killed_command_leaves_no_worker_and_no_file(held):
    proc, worker, tmp = held
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert wait_until(lambda: not alive(worker))
    assert list(tmp.iterdir()) == []


@pytest.mark.slow  # a worker process
@pytest.mark.parametrize("change", ["rename", "append"])
def test_a_trace_changed_while_it_is_read_is_refused_not_mixed(
    tmp_path, monkeypatch, capsys, change
):
    # The file is replaced (as an export writing a new file and renaming it does) or written
    # to after this process opened it and before its worker starts: both parts would have
    # come from different files.
    path = tracegen.write(tmp_path / "t.json", 200)
    other = tracegen.write(tmp_path / "other.json", 20)
    popen = halves.subprocess.Popen

    def changed_first(*args, **kwargs):
        if change == "rename":
            os.replace(other, path)
        else:
            with path.open("ab") as f:
                f.write(b" ")
        return popen(*args, **kwargs)

    monkeypatch.setattr(trace, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(halves.subprocess, "Popen", changed_first)
    assert main(["casts", str(path)]) == 2
    one_line(capsys, str(path), "replaced or written to while it was read")


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
        # caption, "cause", header, rule, the row's cause on a line of its own (it does not
        # fit beside the figures) and its figures, three notes (ops as causes, blank bytes
        # and share), the first wrapped in two lines to fit 100 columns
        ("casts",): 10,
        ("casts", "--by", "cast"): 10,
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


@pytest.mark.slow
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


# Terminals and output streams of every kind


def plain_process(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """``python -m mpguide ARGS`` as a reader runs it, with ``env`` added."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mpguide", *args], env=env, timeout=120, check=False, **kw
    )


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_output_in_an_encoding_that_is_not_utf8(tmp_path, encoding):
    path = write_trace(
        tmp_path / "t.json",
        op("aten::to☃", 1.0, 5.0),
        op("aten::copy_", 2.0, 1.0, **{"Input type": ["c10::BFloat16", "float"]}),
    )
    outs = []
    for command in (["tree", path], ["casts", path], ["casts", path, "--by", "cast"]):
        proc = plain_process(*command, env={"PYTHONIOENCODING": encoding}, capture_output=True)
        assert proc.returncode == 0 and proc.stderr == b"", proc.stderr.decode()[-3000:]
        outs.append(proc.stdout.decode(encoding))
    assert outs[0].splitlines()[1] == "`-- aten::to\\u2603  5.0 us"  # what ASCII carries
    assert (
        outs[0].splitlines()[2]
        == "    `-- aten::copy_  1.0 us  Input type: ['c10::BFloat16', 'float']"
    )
    assert all("aten::to\\u2603  " in out for out in outs[1:])


@pytest.mark.slow
def test_a_closed_stdout_is_one_line(tmp_path, monkeypatch, capsys):
    path = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0))
    proc = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "mpguide", "tree", path],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr == b"mpguide: error: cannot write the output: stdout is closed\n"
    closed = io.StringIO()
    closed.close()  # as the reader's code may do
    monkeypatch.setattr(sys, "stdout", closed)
    assert main(["tree", path]) == 2
    assert capsys.readouterr().err.startswith("mpguide: error: cannot write the output: stdout")


@pytest.mark.slow
def test_the_readers_threads_and_forks_do_not_outlive_or_repeat_the_report(tmp_path):
    (tmp_path / "mine.py").write_text(
        "import os, threading, time\n"
        "import torch\n\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "os.fork()\n\n\n"
        "def make():\n"
        "    return torch.nn.Linear(4, 3), torch.ones(2, 4)\n"
    )
    argv = ["inference", "--model", f"{tmp_path / 'mine.py'}:make", "--variants", "fp32"]
    start = time.monotonic()
    proc = plain_process(*argv, "--warmup", "0", "--repeat", "1", capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert time.monotonic() - start < 100  # not the thread's 600 s
    assert proc.stdout.decode().count("fp32  ") == 1  # one report, from one process


@pytest.mark.slow
def test_huge_cells_are_cut_and_say_their_length(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    dims = [[1] * 5_000_000, [1] * 5_000_000]
    path = write_trace(
        tmp_path / "t.json",
        op("aten::copy_", 1.0, 2.0, **{"Input Dims": dims, "Input type": ["float", "c10::Half"]}),
        op("a" * 300, 4.0, 1.0),
    )
    for args in (["tree", path, "--limit", "0"], ["casts", path, "--by", "cast"]):
        proc = capped(tmp_path, *args, mem_mb=1024)
        assert proc.returncode == 0, proc.stderr.decode()[-3000:]
        out = proc.stdout.decode()
        assert len(out) < 2000 and "characters)" in out
    assert main(["casts", path, "--by", "cast", "--format", "markdown"]) == 0
    assert len(capsys.readouterr().out) < 2000


def test_invisible_marks_are_escaped(tmp_path, capsys):
    marks = "\u200e\u200f\u061c\u200b\u200c\u200d\u2060\ufeff\u00ad"
    path = write_trace(tmp_path / "t.json", op(f"aten::mm{marks}", 1.0, 1.0))
    for command in ("tree", "casts"):
        assert main([command, path, "--format", "json" if command == "tree" else "table"]) == 0
        capsys.readouterr()
    assert main(["tree", path]) == 0
    out = capsys.readouterr().out
    assert not CONTROL.search(out) and not re.search(f"[{marks}]", out)
    assert r"aten::mm\u200e\u200f\u061c\u200b\u200c\u200d\u2060\ufeff\xad" in out


@pytest.mark.slow
def test_times_that_overflow_give_one_line_and_no_warning(tmp_path):
    path = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0), op("big", 1e308, 1e308))
    refused(capped(tmp_path, "tree", path), "event 1 ('big')")
    refused(capped(tmp_path, "casts", path), "event 1 ('big')")


# Directories, caps and options


def test_rank_directories_say_what_they_skipped(tmp_path, capsys):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    write_trace(ranks / "rank0.json", op("a", 1.0, 1.0))
    os.mkfifo(ranks / "rank1.json")
    (ranks / "rank2.json").symlink_to(ranks / "rank2.json")
    assert main(["tree", str(ranks), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank1.json: skipped, a FIFO (named pipe)" in out
    assert "rank2.json: skipped, a symbolic link loop" in out
    assert main(["casts", str(ranks), "--jobs", "1", "--format", "csv"]) == 0
    assert "rank1.json: skipped" in capsys.readouterr().err


def test_a_size_one_byte_over_the_cap_shows_exact_bytes(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([op("a", 1.0, 1.0)] * 20_000))
    size = path.stat().st_size
    assert main(["tree", str(path), "--max-bytes", str(size - 1)]) == 2
    one_line(capsys, f"{size:,} bytes, more than {size - 1:,} bytes")


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_a_file_that_fails_to_read_is_named(capsys):
    assert main(["tree", "/proc/self/mem"]) == 2
    one_line(capsys, "/proc/self/mem: cannot read it")


def test_unknown_options_are_named(tmp_path, capsys):
    path = write_trace(tmp_path / "t.json", op("a", 1.0, 1.0))
    for argv in (["tree", "--bogus"], ["tree", path, "--bogus=3"], ["casts", "-x", path]):
        assert main(argv) == 2
        one_line(capsys, argv[-1] if argv[-1].startswith("-") else "-x")
    assert main(["tree", path, "--lim", "3", "--depth", "-2"]) == 2  # a prefix, a number
    one_line(capsys, "--depth must be 0 or more")


def test_a_graph_function_that_computes_nothing_is_named(tmp_path, capsys):
    (tmp_path / "none.py").write_text("def nothing(x):\n    return None\n")
    assert main(["graph", f"{tmp_path / 'none.py'}:nothing", "--inputs", "f32[4]"]) == 2
    one_line(capsys, "nothing ran no tensor op", "returned NoneType")


def test_empty_variants_are_refused(reader_file, capsys):
    assert main(["inference", "--model", f"{reader_file}:same", "--variants", ""]) == 2
    one_line(capsys, "--variants names none")


# The tree's size: bounded by default, linear in events however deep


def test_the_default_tree_is_bounded_with_durations_and_hidden_events(capsys):
    step = str(Path(__file__).parent / "data" / "gpu" / "a100_torchrec_train_step.json.gz")
    assert main(["tree", step]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 60 and max(map(len, lines)) <= 100
    assert re.fullmatch(r"└── ProfilerStep#\d+  \d+(\.\d+)? ms", lines[1])
    assert re.fullmatch(r"\.\.\. [\d,]+ more nodes not shown \(50 of [\d,]+\): .*", lines[-2])
    qwen = str(Path(__file__).parent / "data" / "gpu" / "h100_qwen1.5-0.5b_bf16_inference.json.gz")
    assert main(["tree", qwen]) == 0
    tail = capsys.readouterr().out.splitlines()[-2:]
    assert re.fullmatch(r"hidden: [\d,]+ python_function events \(--python shows them\)", tail[0])
    assert tail[1].startswith("anomalies: ") and "left out" not in tail[1]


@pytest.mark.slow
def test_a_chain_of_100k_nested_events_draws_in_linear_memory(tmp_path):
    n = 100_000
    chain = tmp_path / "chain.json"
    with chain.open("w") as f:
        f.write("[")
        f.write(",".join(f'{{"ph":"X","name":"a","ts":{k},"dur":{2 * (n - k)}}}' for k in range(n)))
        f.write("]")
    proc = capped(tmp_path, "tree", str(chain), "--limit", "20000", mem_mb=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = proc.stdout.decode().splitlines()
    assert lines[3] == f"        ├── ... {n - 3:,} nested nodes of one child each"
    assert len(lines) == 7 and proc.seconds < 60
    # two children a level: nothing to collapse, and the indentation stops growing
    wide = tmp_path / "wide.json"
    events = [f'{{"ph":"X","name":"a","ts":{2 * k},"dur":{4 * (n - k)}}}' for k in range(n)]
    events += [f'{{"ph":"X","name":"x","ts":{2 * k + 1},"dur":0.5}}' for k in range(n)]
    wide.write_text("[" + ",".join(events) + "]")
    proc = capped(tmp_path, "tree", str(wide), "--limit", "20000", mem_mb=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = proc.stdout.decode()
    assert len(out) < 20000 * 110 and f"[+{10_000 - 1 - calltree.INDENT}]" in out


# Memory bounded by the events a trace holds, not only by its bytes


@pytest.mark.slow
def test_many_tiny_events_under_the_byte_cap_are_refused_in_seconds(tmp_path):
    events = TINY * (MiB // len(TINY))
    bomb = tmp_path / "tiny.json.gz"  # 1.9 GiB of tiny events (55 million) in 6 MB
    bomb.write_bytes(gzip_members((b"[", 1), (events, 1950), (b'{"ph":"X"}]', 1)))
    for command in ("casts", "tree"):
        proc = capped(tmp_path, command, str(bomb), "--limit", "10", mem_mb=1024)
        err = refused(proc, "events (projected from the first", "would need about", "ulimit -v")
        assert f"{trace.BYTES_PER_EVENT} bytes an event" in err and proc.seconds < 30
    plain = tmp_path / "tiny.json"  # 2.7 million events in 100 MiB, counted before decoding
    plain.write_bytes(b"[" + events * 100 + b'{"ph":"X"}]')
    proc = capped(tmp_path, "casts", str(plain), mem_mb=300)
    refused(proc, "about 2,", "events would need about")
    assert proc.seconds < 30
    for command in ("casts", "tree"):  # and read to the end where the estimate fits
        proc = capped(tmp_path, command, str(plain), "--limit", "10", mem_mb=768)
        assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    small = tmp_path / "small.json.gz"  # 110,000 events fit in 512 MiB
    small.write_bytes(gzip_members((b"[", 1), (events, 4), (b'{"ph":"X"}]', 1)))
    proc = capped(tmp_path, "casts", str(small), mem_mb=512)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]


def test_the_memory_estimate_is_checked_as_a_stream_is_read(monkeypatch, capsys):
    events = TINY * 100_000 + b'{"ph":"X"}]'
    monkeypatch.setattr(
        sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(b"[" + events)))
    )
    monkeypatch.setattr(
        "mpguide.traces.trace.available_memory", lambda: (10 << 20, "a test's limit")
    )
    assert main(["tree", "-"]) == 2
    one_line(capsys, "<stream>: about 100,001 events would need", "a test's limit")


@pytest.mark.slow  # a fresh interpreter or a pool of processes
def test_jobs_are_capped_at_the_cores_and_the_memory(tmp_path, monkeypatch, capsys):
    from mpguide.traces import ranks

    for k in range(3):
        tracegen.write(tmp_path / f"rank{k}.json", 40, seed=k)
    cores = ranks._cores()
    found = ranks.trees_of_ranks(tmp_path, jobs=40)
    assert found.how.startswith("read by ") and "--jobs 40 capped at" in found.how
    assert f"read by {min(cores, 3)} processes" in found.how or cores == 1
    monkeypatch.setattr(
        "mpguide.traces.trace.available_memory", lambda: (150 << 20, "a test's limit")
    )
    assert ranks.most_jobs(ranks.files(tmp_path))[0] == 1
    found = ranks.trees_of_ranks(tmp_path, jobs=40)
    assert found.how == "read by this process (--jobs 40 capped at what 150 MiB of memory holds)"
    with pytest.raises(SystemExit):
        main(["tree", "--help"])
    assert "fewer where the free memory" in " ".join(capsys.readouterr().out.split())


@pytest.mark.slow
def test_a_reader_that_closes_the_pipe_early_gets_141_and_silence(tmp_path):
    path = tracegen.write(tmp_path / "t.json", 3000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpguide", "tree", str(path), "--limit", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    with proc.stdout, proc.stderr:
        assert proc.stdout.readline()  # as `| head -1` does, then it stops reading
        proc.stdout.close()
        err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""
