"""Fuzz ``tree`` and ``casts`` over trace documents and option values, and check the
command line's contract on every input: exit 0 with valid output (strict JSON, CSV that
parses, text without control characters), or exit 2 with one line on stderr; memory bounded
by a constant; nothing left in the temporary directory.

The documents are chrome traces with fields of any type and value (names with control
characters, times past any clock, args nested deep), then cut, spliced, framed, compressed
or inflated into small compression bombs, or are chains of identical events that nest as
deep as they are long.
"""

import contextlib
import csv
import gzip
import io
import json
import os
import re
import tempfile
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpguide.cli import main
from mpguide.traces import trace

# Slow: hundreds of command runs (nox -s tests -- -m 'not slow' leaves it out).
pytestmark = pytest.mark.slow

CONTROL = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]"
)
PEAK = 96 << 20
"""The most memory one command may take beyond what the process held before it, on these
small inputs: the documents are at most a few hundred kilobytes, the inflated ones 4 MiB."""

NAMES = ["aten::copy_", "aten::to", "aten::_to_copy", "aten::mm", "ProfilerStep#1",
         "cudaLaunchKernel", "triton_poi_fused__to_copy_0", "autograd::engine::evaluate_function: X"]  # fmt: skip
CATS = ["cpu_op", "kernel", "cuda_runtime", "python_function", "user_annotation", "ac2g",
        "gpu_memcpy", "gpu_user_annotation", ""]  # fmt: skip
TYPES = ["float", "c10::BFloat16", "c10::Half", "double", "Scalar", ""]
ARG_KEYS = ["Input type", "Input Dims", "Concrete Inputs", "correlation", "External id"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(TYPES),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
times = st.one_of(
    st.floats(0, 1e4),
    st.floats(-1e17, 1e17, allow_nan=False),
    st.integers(-(2**64), 2**64),
    st.sampled_from([0, 4.4e12, 9.2e15, -1.0]),
)
texts = st.one_of(st.sampled_from(NAMES), st.text(max_size=12))
events = st.fixed_dictionaries(
    {},
    optional={
        "ph": st.sampled_from(["X", "X", "X", "X", "s", "f", "M", "i", "B"]) | values,
        "name": texts | values,
        "cat": st.sampled_from(CATS) | values,
        "pid": st.integers(0, 3) | texts | values,
        "tid": st.integers(0, 3) | texts | values,
        "ts": times | values,
        "dur": times | values,
        "id": st.integers(0, 5) | values,
        "args": st.dictionaries(st.sampled_from(ARG_KEYS) | st.text(max_size=4), values, max_size=4)
        | values,
    },
)
timed = st.fixed_dictionaries(
    {"ph": st.just("X"), "name": texts, "cat": st.sampled_from(CATS), "pid": st.integers(0, 2),
     "tid": st.integers(0, 2), "ts": st.floats(0, 100), "dur": st.floats(0, 50)},
    optional={"args": st.dictionaries(st.sampled_from(ARG_KEYS), values, max_size=3),
              "id": st.integers(0, 5)},
)  # fmt: skip
"""Events that nest: most documents should get past reading."""


@st.composite
def documents(draw) -> bytes:
    """A chrome-trace document, then maybe broken at the byte level."""
    listed = draw(st.lists(st.one_of(timed, timed, events), max_size=20))
    doc = listed if draw(st.booleans()) else {"traceEvents": listed, "x": draw(values)}
    data = json.dumps(doc, indent=draw(st.sampled_from([None, 1]))).encode()
    how = draw(
        st.sampled_from(
            ["as is"] * 6 + ["cut", "splice", "frame", "nest", "chain", "gzip", "inflate"]
        )
    )
    if how == "cut":
        data = data[: draw(st.integers(0, len(data)))]
    elif how == "splice":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(max_size=8)) + data[at + draw(st.integers(0, 4)) :]
    elif how == "frame":
        data = draw(st.sampled_from([b"\xef\xbb\xbf", b"  \n", b"\xff\xfe", b"\x00", b""])) + data
    elif how == "nest":
        depth = draw(st.integers(1, 3000))
        nested = b"[" * depth + b"]" * depth
        data = b'[{"ph": "X", "ts": 1, "dur": 1, "args": {"a": %s}}]' % nested
    elif how == "chain":  # identical intervals nest in file order: a tree as deep as long
        data = json.dumps([{"ph": "X", "ts": 1, "dur": 1}] * draw(st.integers(1, 2500))).encode()
    if how == "gzip" or draw(st.integers(0, 9)) == 0:
        data = gzip.compress(data, mtime=0)
    if how == "inflate":
        filler = gzip.compress(draw(st.sampled_from([b" ", b"\x00", b"[", b"{"])) * (1 << 20))
        data = gzip.compress(data[:1], mtime=0) + filler * draw(st.integers(1, 4))
    return data


def options(command: str):
    common = {
        "--max-bytes": st.sampled_from(["1K", "64K", "4M", "2G", "0", "x", "-1", "1.5M"]),
    }
    if command == "casts":
        specific = {
            "--format": st.sampled_from(["table", "markdown", "json", "csv", "xml"]),
            "--by": st.sampled_from(["cast", "cause", "pair", "direction", "pass", "op"]),
        }
    else:
        specific = {
            "--format": st.sampled_from(["text", "json", "csv"]),
            "--depth": st.integers(-2, 4).map(str),
            "--limit": st.integers(-1, 6).map(str),
            "--fields": texts | st.sampled_from(["Input type,Input Dims", ",", ""]),
            "--op": texts,
            "--id": st.integers(-2, 40).map(str) | texts,
            "--python": st.just(None),
            "--gpu": st.just(None),
        }
    every = {**common, **specific}
    chosen = st.lists(st.sampled_from(sorted(every)), unique=True, max_size=4)
    return chosen.flatmap(lambda keys: st.fixed_dictionaries({k: every[k] for k in keys}))


@st.composite
def command_lines(draw) -> tuple[str, dict]:
    command = draw(st.sampled_from(["tree", "casts"]))
    return command, draw(options(command))


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


@contextlib.contextmanager
def peak_memory():
    """The most memory the block took beyond what the process held before it, in bytes, in
    the list yielded: the peak resident set on Linux (reset through /proc/self/clear_refs),
    else the peak that tracemalloc counts (slower)."""
    took = []
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _kib("VmRSS:")
    except OSError:
        tracemalloc.start()
        try:
            yield took
            took.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        return
    yield took
    took.append((_kib("VmHWM:") - before) << 10)


def check_contract(argv: list[str], tmp: str) -> None:
    """Run ``main(argv)`` and check the contract (see the module docstring)."""
    out, err = io.StringIO(), io.StringIO()
    with peak_memory() as took, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    out, err = out.getvalue(), err.getvalue()
    assert took[0] < PEAK, f"{took[0] / 2**20:.0f} MiB"
    assert not list(os.scandir(tmp))
    if status == 2:
        assert out == "" and err.startswith("mpguide: error: ") and err.count("\n") == 1, err
        assert not CONTROL.search(err)
        return
    assert status == 0, err
    assert all(line.startswith("mpguide: note: ") for line in err.splitlines()), err
    fmt = argv[argv.index("--format") + 1] if "--format" in argv else "text"
    if fmt == "json":

        def refuse(constant):
            raise AssertionError(f"{constant} in JSON output")

        json.loads(out, parse_constant=refuse)
    elif fmt == "csv":
        assert list(csv.reader(io.StringIO(out)))
    else:
        assert not CONTROL.search(out), out


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(documents(), command_lines())
def test_every_document_and_option_keeps_the_contract(tmp_path_factory, data, line):
    command, chosen = line
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "trace.json"
    path.write_bytes(data)
    argv = [command, str(path)]
    for option, value in chosen.items():
        argv += [option] if value is None else [option, value]
    tmp = folder / "tmp"
    tmp.mkdir()
    before = tempfile.tempdir
    tempfile.tempdir = str(tmp)
    try:
        check_contract(argv, str(tmp))
    finally:
        tempfile.tempdir = before


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(timed, events), min_size=40, max_size=200), st.integers(0, 400))
def test_the_two_process_decode_keeps_the_contract(tmp_path_factory, listed, cut):
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "trace.json"
    data = json.dumps({"traceEvents": listed}).encode()
    path.write_bytes(data[: len(data) - cut])
    tmp = folder / "tmp"
    tmp.mkdir()
    before, threshold = tempfile.tempdir, trace.PARALLEL_BYTES
    tempfile.tempdir, trace.PARALLEL_BYTES = str(tmp), 0
    try:
        check_contract(["casts", str(path), "--format", "json"], str(tmp))
    finally:
        tempfile.tempdir, trace.PARALLEL_BYTES = before, threshold


def independent_casts(events: list[dict]) -> int:
    """How many casts a generated trace holds, counted from the generator's own parent links
    and the raw args, not from the call tree: the top op of each chain of cast ops, when a
    ``copy_`` in its chain names two different dtypes."""
    cast_ops = {"aten::to", "aten::_to_copy", "aten::copy_"}
    below: dict[int, list[int]] = {}
    for k, e in enumerate(events):
        below.setdefault(e["parent"], []).append(k)
    found = 0
    for k, e in enumerate(events):
        up = e["parent"]
        if e["name"] not in cast_ops or (up >= 0 and events[up]["name"] in cast_ops):
            continue
        chain, converts = [k], False
        while chain:
            i = chain.pop()
            types = events[i].get("args", {}).get("Input type", [])
            converts |= events[i]["name"] == "aten::copy_" and len(set(types[:2])) == 2
            chain += [j for j in below.get(i, []) if events[j]["name"] in cast_ops]
        found += converts
    return found


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 400), st.booleans(), st.booleans(), st.integers(1, 3), st.integers(0, 99))
def test_the_casts_found_are_the_casts_generated(tmp_path_factory, ops, python, gpu, threads, seed):
    from mpguide.traces import casts, tracegen

    generated = list(tracegen.generate(ops, python=python, gpu=gpu, threads=threads, seed=seed))
    want = independent_casts(generated)
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "trace.json"
    path.write_text(json.dumps({"traceEvents": [tracegen._json(e) for e in generated]}))
    assert want > 0 and len(casts.report(trace.load(path).tree(python=True))) == want
    tmp = folder / "tmp"
    tmp.mkdir()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(
                [
                    "casts",
                    str(path),
                    "--by",
                    "cast",
                    "--scalars",
                    "--limit",
                    "0",
                    "--format",
                    "json",
                ]
            )
            == 0
        )
    assert len(json.loads(out.getvalue())["rows"]) == want
    check_contract(["casts", str(path), "--format", "json"], str(tmp))
