import gzip
import json

import pytest
import torch

from mpguide import MPGuideError
from mpguide.traces import trace
from mpguide.traces.profiling import activities, profile_fn


def matmul_step():
    a = torch.ones(8, 4)
    return a @ a.T


def test_profile_fn_records_the_active_steps_only():
    calls = []
    tr = profile_fn(lambda: calls.append(matmul_step()), wait=1, warmup=1, active=2)
    assert len(calls) == 4
    tree = tr.tree()
    steps = tree.find(
        predicate=lambda n: n.cat == "user_annotation" and n.name.startswith("ProfilerStep#")
    )
    assert [s.name for s in steps] == ["ProfilerStep#2", "ProfilerStep#3"]
    mms = tree.find("aten::mm")
    assert len(mms) == 2 and mms[0].field("Input Dims") == [[8, 4], [4, 8]]
    assert tr.source == ""


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_profile_fn_writes_the_trace(tmp_path, name):
    path = tmp_path / name
    tr = profile_fn(matmul_step, path=path)
    assert tr.source == str(path)
    raw = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
    assert "traceEvents" in json.loads(raw)
    assert trace.load(path).tree().find("aten::mm")


def test_profile_fn_with_stack_adds_python_events():
    tr = profile_fn(matmul_step, with_stack=True)
    assert any(e.cat == "python_function" for e in tr.events)


def test_bad_schedule():
    with pytest.raises(MPGuideError, match="active >= 1"):
        profile_fn(matmul_step, active=0)


def test_activities_follow_the_machine():
    assert (torch.profiler.ProfilerActivity.CUDA in activities()) == torch.cuda.is_available()


@pytest.mark.gpu
def test_cuda_kernels_hang_under_their_launches():
    a = torch.ones(256, 256, device="cuda")
    tree = profile_fn(lambda: a @ a).tree()
    (mm,) = tree.find("aten::mm")
    assert mm.gpu_time > 0
    kernels = [n for n in mm.walk() if n.is_gpu]
    assert kernels and all(k.parent.cat == "cuda_runtime" for k in kernels)
    assert tree.anomalies.unlinked_gpu == 0
