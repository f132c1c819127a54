import gzip
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from helpers import ROOT

from mpguide import MPGuideError
from mpguide.cli import main
from mpguide.traces import casts, ranks, trace, tracegen

RANKS = Path(__file__).parent / "data" / "ranks"
GPU = {"kernel", "gpu_memcpy", "gpu_memset"}


def events_of(path: Path) -> list[dict]:
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def with_info(path: Path, rank: int, ops: int, seed: int) -> Path:
    """A generated trace with the ``distributedInfo`` the profiler writes before its events."""
    encode = msgspec.json.Encoder().encode
    events = [tracegen._json(e) for e in tracegen.generate(ops, seed=seed)]
    info = {"backend": "nccl", "rank": rank, "world_size": 8, "pg_config": [{"ranks": [0, 1]}]}
    path.write_bytes(
        b'{"schemaVersion": 1, "distributedInfo": '
        + encode(info)
        + b', "traceEvents": '
        + encode(events)
        + b"}"
    )
    return path


@pytest.mark.slow
def test_real_ranks_as_the_per_file_report_gives_them():
    found = ranks.casts_of_ranks(RANKS, jobs=2)
    assert [(r.rank, r.origin) for r in found.rows] == [
        (0, "distributedInfo"),
        (1, "distributedInfo"),
    ]
    gpu = {}
    for row in found.rows:
        tree = trace.load(row.file).tree(python=True)
        report = casts.report(tree)
        assert row.casts == len(report) > 0
        assert row.cpu_us == pytest.approx(float(report.cpu_us.sum()))
        assert row.gpu_us == pytest.approx(float(report.gpu_us.sum())) and report.gpu
        assert row.step_us == report.step_us
        first = report.summary("cause", scalars=False).rows[0]  # 0-d casts folded
        assert (row.top, row.top_cpu_us) == (first[0], first[4])
        gpu[row.rank] = row.gpu_us
    summary = {r[0]: r for r in found.summary().rows}
    _, n, most, top, median, low, over = summary["cast gpu us"]
    slowest = max(gpu, key=gpu.get)
    assert (n, most, top) == (2, f"rank {slowest}", gpu[slowest])
    assert median == statistics.median(gpu.values()) and low == min(gpu.values())
    assert over == round(gpu[slowest] / median, 3)
    assert found.summary().notes[0].startswith(f"most time in casts: rank {slowest} (cast gpu us")
    assert "read by 2 processes on this machine" in found.table().caption


def test_real_trees_against_the_raw_events():
    found = ranks.trees_of_ranks(RANKS, op="nccl:all_reduce", jobs=1)
    for row in found.rows:
        raw = events_of(Path(row.file))
        steps = [e["dur"] for e in raw if e["name"].startswith("ProfilerStep#")]
        ops = [e["dur"] for e in raw if e["name"] == "nccl:all_reduce"]
        assert row.events == len(raw)
        assert (row.steps, row.step_us) == (len(steps), pytest.approx(sum(steps)))
        assert row.gpu_us == pytest.approx(sum(e["dur"] for e in raw if e.get("cat") in GPU))
        assert (row.op_count, row.op_us) == (len(ops), pytest.approx(sum(ops))) and ops
    table = found.table()
    assert table.columns[-3:] == ("op", "op count", "op us")
    assert found.table().caption.endswith("read by this process")


@pytest.mark.slow  # a fresh interpreter or a pool of processes
def test_rank_from_the_trace_then_the_name_then_unknown(tmp_path):
    with_info(tmp_path / "rank-9.json", rank=3, ops=60, seed=1)
    tracegen.write(tmp_path / "worker_rank7.json.gz", 120, seed=2)
    tracegen.write(tmp_path / "trace.json", 60, seed=3, gpu=True)
    (tmp_path / "notes.txt").write_text("not a trace")
    (tmp_path / "sub").mkdir()
    tracegen.write(tmp_path / "sub" / "rank0.json", 60)
    found = ranks.casts_of_ranks(tmp_path, by="pair", jobs=3)
    assert [(r.rank, r.origin, Path(r.file).name) for r in found.rows] == [
        (3, "distributedInfo", "rank-9.json"),
        (7, "file name", "worker_rank7.json.gz"),
        (None, "unknown", "trace.json"),
    ]
    table = found.table()
    assert table.column("top pair")[0] == "float32 -> bfloat16"
    assert table.column("cast gpu us") == [None, None, round(found.rows[2].gpu_us, 3)]
    assert table.notes == ("1 trace(s) of unknown rank: no distributedInfo, no rank in the name",)
    most = {r[0]: r[2] for r in found.summary().rows}
    assert most["cast gpu us"] == "trace.json"  # the only one with GPU events
    assert most["casts"] == "rank 7"  # twice the ops of the others


@pytest.mark.parametrize("gz", [False, True])
def test_distributed_info_as_the_first_key_is_read(tmp_path, gz):
    events = [tracegen._json(e) for e in tracegen.generate(20, seed=1)]
    doc = json.dumps({"distributedInfo": {"rank": 5}, "traceEvents": events}).encode()
    path = tmp_path / ("rank3.json.gz" if gz else "rank3.json")
    path.write_bytes(gzip.compress(doc) if gz else doc)
    assert ranks.rank_of(path) == (5, "distributedInfo")


def test_a_distributed_info_without_a_valid_rank_is_named(tmp_path):
    events = [tracegen._json(e) for e in tracegen.generate(20, seed=1)]
    for name, info in [
        ("rank1.json", {"rank": -1}),
        ("a.json", {"rank": 1e30}),
        ("b.json", {"rank": "3"}),
        ("c.json", {"backend": "nccl"}),
    ]:
        (tmp_path / name).write_text(json.dumps({"distributedInfo": info, "traceEvents": events}))
    tracegen.write(tmp_path / "d.json", 20)
    found = ranks.trees_of_ranks(tmp_path, jobs=1)
    assert [(r.rank, r.origin, Path(r.file).name) for r in found.rows] == [
        (1, "file name; distributedInfo rank -1, not a rank", "rank1.json"),
        (None, "unknown; distributedInfo rank 1e+30, not a rank", "a.json"),
        (None, 'unknown; distributedInfo rank "3", not a rank', "b.json"),
        (None, "unknown; distributedInfo rank missing", "c.json"),
        (None, "unknown", "d.json"),
    ]
    unknown, bad = found.table().notes
    assert unknown == "1 trace(s) of unknown rank: no distributedInfo, no rank in the name"
    assert bad.startswith("4 trace(s) whose distributedInfo has no valid rank: rank1.json (")


def test_an_unreadable_directory_is_named(tmp_path, monkeypatch):
    tracegen.write(tmp_path / "rank0.json", 20)
    if os.geteuid() == 0:  # root reads a folder whatever its mode: have the listing fail

        def denied(path):
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(ranks.os, "listdir", denied)
    else:
        tmp_path.chmod(0)
    try:
        with pytest.raises(MPGuideError, match="cannot list it \\(Permission denied\\)"):
            ranks.trees_of_ranks(tmp_path, jobs=1)
    finally:
        tmp_path.chmod(0o700)


def test_traces_of_one_rank_are_rows_of_their_own(tmp_path):
    for name, seed in (("a_rank1.json", 1), ("b_rank1.json", 2)):
        tracegen.write(tmp_path / name, 60, seed=seed)
    found = ranks.trees_of_ranks(tmp_path, jobs=1)
    assert found.table().notes == ("ranks with several traces, one row each: 1",)
    labels = {r[2] for r in found.summary().rows}
    assert labels <= {"rank 1 (a_rank1.json)", "rank 1 (b_rank1.json)", "2 tied"}


def test_bad_directories_and_arguments(tmp_path):
    with pytest.raises(MPGuideError, match="no traces in it"):
        ranks.casts_of_ranks(tmp_path)
    with pytest.raises(MPGuideError, match="not a directory"):
        ranks.casts_of_ranks(tmp_path / "missing")
    tracegen.write(tmp_path / "rank0.json", 60)
    with pytest.raises(MPGuideError, match="jobs must be 1 or more"):
        ranks.casts_of_ranks(tmp_path, jobs=0)
    with pytest.raises(MPGuideError, match="unknown summary 'cast'"):
        ranks.casts_of_ranks(tmp_path, by="cast")
    with pytest.raises(MPGuideError, match="not both"):
        ranks.trees_of_ranks(tmp_path, jobs=2, scheduler="tcp://127.0.0.1:1")
    with pytest.raises(MPGuideError, match="no Dask scheduler at nowhere"):
        ranks.trees_of_ranks(tmp_path, scheduler="nowhere")


@pytest.mark.slow  # a fresh interpreter or a pool of processes
def test_a_broken_trace_stops_the_pool_and_is_named(tmp_path):
    for r in range(3):
        tracegen.write(tmp_path / f"rank{r}.json", 60, seed=r)
    (tmp_path / "rank3.json").write_text('{"traceEvents": [{"ph": "X", "name": "aten::mm"')
    with pytest.raises(MPGuideError, match=r"rank3\.json: not valid JSON"):
        ranks.casts_of_ranks(tmp_path, jobs=2)


@pytest.mark.slow  # a fresh interpreter or a pool of processes
def test_cli_on_a_directory(capsys, monkeypatch):
    assert main(["casts", str(RANKS), "--by", "direction", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in doc["ranks"]["rows"]] == [0, 1]
    assert "top direction" in doc["ranks"]["rows"][0]
    assert {r["figure"] for r in doc["summary"]["rows"]} == set(ranks.RankCasts.FIGURES)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["tree", str(RANKS), "--jobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"trees of 2 traces in {RANKS}, read by this process")
    assert "trees across ranks" in out and out.rstrip().splitlines()[-1].startswith(
        "longest profiled steps: rank "
    )
    assert err.splitlines() == [
        f"mpguide: {k + 1}/2 rank {k} read ({RANKS / f'sampled_rank-{k}.json.gz'})" for k in (0, 1)
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tree", str(RANKS), "--depth", "1"], "--id and --depth show one trace's tree"),
        (["casts", str(RANKS / "sampled_rank-0.json.gz"), "--jobs", "2"], "read a directory"),
        (["casts", str(RANKS), "--jobs", "0"], "--jobs must be 1 or more, got 0"),
        (["casts", str(RANKS), "--max-bytes", "64K"], "64 KiB"),
        (["tree", str(RANKS), "--max-bytes", "64K", "--jobs", "1"], "--max-bytes"),
    ],
)
def test_cli_bad_arguments(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpguide: error: ") and message in err and len(err.splitlines()) == 1


def test_without_dask_the_error_names_the_extra(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)
    assert main(["casts", str(RANKS), "--scheduler", "tcp://127.0.0.1:8786"]) == 2
    assert capsys.readouterr().err == (
        "mpguide: error: a Dask scheduler needs dask[distributed]: pip install mpguide[cluster]\n"
    )


@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed", reason="dask[distributed] is not installed")
    import dask

    once = {"distributed.scheduler.allowed-failures": 0}  # a dead worker fails its task at once
    with (
        dask.config.set(once),
        distributed.LocalCluster(
            n_workers=2,
            processes=True,
            threads_per_worker=1,
            dashboard_address=":0",  # any free port
        ) as local,
    ):
        yield local


@pytest.mark.slow
def test_a_local_cluster_of_two_workers_gives_what_the_pool_gives(cluster, capsys, tmp_path):
    address = cluster.scheduler_address
    on_cluster = ranks.casts_of_ranks(RANKS, scheduler=address)
    assert on_cluster.rows == ranks.casts_of_ranks(RANKS, jobs=1).rows
    assert on_cluster.how == f"read by the 2 workers of the Dask cluster at {address}"
    assert main(["tree", str(RANKS), "--scheduler", address, "--op", "nccl:all_reduce"]) == 0
    assert "nccl:all_reduce" in capsys.readouterr().out.split("trees across ranks")[0]
    shutil.copy(RANKS / "sampled_rank-0.json.gz", tmp_path / "rank0.json.gz")
    (tmp_path / "rank1.json").write_text('{"rows": []}')
    assert main(["casts", str(tmp_path), "--scheduler", address]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpguide: error: ") and "rank1.json: not a chrome trace" in err


@pytest.fixture
def quick_connect(monkeypatch):
    monkeypatch.setattr(ranks, "_CONNECT_S", 1)


@pytest.mark.slow
def test_a_port_where_something_else_listens_is_one_line_in_time(capsys, quick_connect):
    pytest.importorskip("distributed", reason="dask[distributed] is not installed")
    with socket.create_server(("127.0.0.1", 0)) as server:  # accepts, never answers
        address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        start = time.monotonic()
        assert main(["tree", str(RANKS), "--scheduler", address]) == 2
        assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert err == (
        f"mpguide: error: no Dask scheduler at {address}: something listens there but gave no "
        "Dask answer within 1 s\n"
    )


@pytest.mark.slow
def test_a_scheduler_without_workers_is_one_line_in_time(capsys, quick_connect):
    distributed = pytest.importorskip("distributed", reason="dask[distributed] is not installed")
    with distributed.LocalCluster(n_workers=0, dashboard_address=":0") as empty:
        address = empty.scheduler_address
        start = time.monotonic()
        assert main(["casts", str(RANKS), "--scheduler", address]) == 2
        assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert err == (
        f"mpguide: error: the Dask scheduler at {address} has no workers (none came within 1 s)\n"
    )


@pytest.mark.slow
def test_a_relative_directory_reaches_the_workers(cluster, monkeypatch):
    """The workers have their own working directory: the paths sent are absolute, and the
    rows name the files as the reader gave them."""
    monkeypatch.chdir(RANKS.parent)
    on_cluster = ranks.casts_of_ranks(RANKS.name, scheduler=cluster.scheduler_address)
    assert on_cluster.rows == ranks.casts_of_ranks(RANKS.name, jobs=1).rows
    assert all(not Path(r.file).is_absolute() for r in on_cluster.rows)


@pytest.mark.slow
def test_a_worker_that_dies_names_its_trace(cluster):
    path = str(RANKS / "sampled_rank-0.json.gz")
    with pytest.raises(MPGuideError, match="the Dask workers reading it died"):
        ranks._on_cluster(lambda p: os._exit(1), [path], cluster.scheduler_address, None)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_ctrl_c_leaves_no_process_behind(ctrl_c_heard, tmp_path):
    first = tracegen.write(tmp_path / "rank0.json", 40_000)
    for r in range(1, 8):
        os.link(first, tmp_path / f"rank{r}.json")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpguide", "casts", str(tmp_path), "--jobs", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:  # 2 workers, a tracker
        time.sleep(0.05)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.decode() == "mpguide: interrupted\n"
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("processes of the command outlived it")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_a_killed_command_takes_its_pool_with_it_quietly(tmp_path):
    first = tracegen.write(tmp_path / "rank0.json", 40_000)
    for r in range(1, 8):
        os.link(first, tmp_path / f"rank{r}.json")
    err = tmp_path / "err"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mpguide", "casts", str(tmp_path), "--jobs", "2"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:  # 2 workers, a tracker
        time.sleep(0.05)
    time.sleep(0.5)  # the workers are reading
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    while time.monotonic() - killed < 30:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    gone = time.monotonic() - killed
    assert gone < 5, f"the pool outlived the command by {gone:.1f} s"
    assert err.read_text() == ""  # no BrokenPipeError, no leaked-semaphore warning
