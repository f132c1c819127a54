import multiprocessing
import pickle

import pytest
import torch

from mpguide.autocast import policy
from mpguide.core import device, stored


def test_nothing_is_kept_without_the_folder(monkeypatch):
    monkeypatch.delenv(stored.ENV, raising=False)
    calls = []
    for _ in range(2):
        assert stored.kept("k", (1,), lambda: calls.append(1) or len(calls)) == len(calls)
    assert calls == [1, 1]


def test_a_result_is_computed_once_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv(stored.ENV, str(tmp_path / "cache"))
    calls = []

    def compute():
        calls.append(1)
        return {"n": len(calls)}

    assert stored.kept("k", (1,), compute) == {"n": 1}
    assert stored.kept("k", (1,), compute) == {"n": 1}
    assert stored.kept("k", (2,), compute) == {"n": 2}
    assert stored.kept("other", (1,), compute) == {"n": 3}
    assert len(calls) == 3
    assert len(list((tmp_path / "cache").glob("*.pickle"))) == 3


def test_a_broken_file_is_computed_again_and_an_unwritable_folder_computes(tmp_path, monkeypatch):
    monkeypatch.setenv(stored.ENV, str(tmp_path))
    stored.kept("k", (1,), lambda: 1)
    (path,) = tmp_path.glob("*.pickle")
    path.write_bytes(b"not a pickle")
    assert stored.kept("k", (1,), lambda: 2) == 2
    assert pickle.loads(path.read_bytes()) == 2
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(stored.ENV, str(blocker / "below"))
    assert stored.kept("k", (1,), lambda: 3) == 3


def _slow_square(folder, x, out):
    import os
    import time

    os.environ[stored.ENV] = folder

    def compute():
        time.sleep(0.5)
        with open(out, "a") as f:
            f.write("computed\n")
        return x * x

    return stored.kept("square", (x,), compute)


@pytest.mark.slow  # three fresh interpreters
def test_processes_asking_at_once_take_turns(tmp_path):
    out = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        got = pool.starmap(_slow_square, [(str(tmp_path / "c"), 7, str(out))] * 3)
    assert got == [49, 49, 49]
    assert out.read_text() == "computed\n"


@pytest.mark.slow  # probes every registered op, simulated and on the CPU
def test_a_policy_of_every_op_is_kept_and_one_of_chosen_ops_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv(stored.ENV, str(tmp_path))
    first = [policy.probe("cuda", torch.bfloat16, simulate=True), policy.probe("cpu")]
    assert [p.how for p in first] == [device.SIMULATED, device.LIVE]
    with monkeypatch.context() as m:
        m.setattr(policy, "probe_op", None)  # a probe that probed again would fail
        again = [policy.probe("cuda", torch.bfloat16, simulate=True), policy.probe("cpu")]
    for a, b in zip(first, again, strict=True):
        assert (a.how, a.caption) == (b.how, b.caption)
        assert [(p.op, p.kind, p.note) for p in a.probes] == [
            (p.op, p.kind, p.note) for p in b.probes
        ]
    assert len(list(tmp_path.glob("policy-*.pickle"))) == 2
    ops = policy.registered()[:3]
    policy.probe("cpu", torch.bfloat16, ops=ops)
    policy.probe("cuda", torch.bfloat16, ops=ops, simulate=True)
    assert len(list(tmp_path.glob("policy-*.pickle"))) == 2
