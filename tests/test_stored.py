import errno
import multiprocessing
import os
import pickle
import signal

import pytest
import torch

from mpguide.autocast import policy
from mpguide.core import device, stored


def test_nothing_is_kept_without_the_folder(monkeypatch):
    monkeypatch.delenv(stored.ENV, raising=False)
    calls = []
    for _ in range(2):
        assert stored.kept("k", (1,), lambda: calls.append(1) or len(calls), int) == len(calls)
    assert calls == [1, 1]


def test_a_result_is_computed_once_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv(stored.ENV, str(tmp_path / "cache"))
    calls = []

    def compute():
        calls.append(1)
        return {"n": len(calls)}

    assert stored.kept("k", (1,), compute, dict) == {"n": 1}
    assert stored.kept("k", (1,), compute, dict) == {"n": 1}
    assert stored.kept("k", (2,), compute, dict) == {"n": 2}
    assert stored.kept("other", (1,), compute, dict) == {"n": 3}
    assert len(calls) == 3
    assert len(list((tmp_path / "cache").glob("*.pickle"))) == 3


def test_a_broken_file_is_computed_again_and_an_unwritable_folder_computes(tmp_path, monkeypatch):
    monkeypatch.setenv(stored.ENV, str(tmp_path))
    stored.kept("k", (1,), lambda: 1, int)
    (path,) = tmp_path.glob("*.pickle")
    path.write_bytes(b"not a pickle")
    assert stored.kept("k", (1,), lambda: 2, int) == 2
    assert pickle.loads(path.read_bytes()) == 2
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(stored.ENV, str(blocker / "below"))
    assert stored.kept("k", (1,), lambda: 3, int) == 3


def _one_file(folder, suffix):
    (path,) = folder.glob(f"*{suffix}")
    return path


@pytest.mark.parametrize(
    "damage",
    [
        b"\x80\x09K\x01.",  # a protocol this Python does not know
        b"cno_such_module\nThing\n)\x81.",  # a class of a module that is not there
        pickle.dumps("a string"),  # readable, of the wrong type
        pickle.dumps(ValueError),  # a type, not an instance
    ],
)
def test_a_damaged_result_is_computed_again(tmp_path, monkeypatch, damage):
    monkeypatch.setenv(stored.ENV, str(tmp_path))
    stored.kept("k", (1,), lambda: 1, int)
    _one_file(tmp_path, ".pickle").write_bytes(damage)
    assert stored.kept("k", (1,), lambda: 2, int) == 2
    assert pickle.loads(_one_file(tmp_path, ".pickle").read_bytes()) == 2


def _within_5_s(call):
    """``call()``, failing the test if it takes more than 5 s (a FIFO opened would wait)."""

    def late(*_):
        raise TimeoutError("waited on a FIFO")

    old = signal.signal(signal.SIGALRM, late)
    signal.alarm(5)
    try:
        return call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("suffix", [".pickle", ".lock"])
def test_a_fifo_in_place_of_a_file_is_computed_without_waiting(tmp_path, monkeypatch, suffix):
    monkeypatch.setenv(stored.ENV, str(tmp_path))
    stored.kept("k", (1,), lambda: 1, int)
    path = _one_file(tmp_path, suffix)
    path.unlink()
    os.mkfifo(path)
    assert _within_5_s(lambda: stored.kept("k", (1,), lambda: 2, int)) == 2
    assert list(tmp_path.glob("*.part")) == []


def test_a_folder_in_place_of_the_result_computes_and_leaves_no_part(tmp_path, monkeypatch):
    monkeypatch.setenv(stored.ENV, str(tmp_path))
    stored.kept("k", (1,), lambda: 1, int)
    path = _one_file(tmp_path, ".pickle")
    path.unlink()
    path.mkdir()
    assert stored.kept("k", (1,), lambda: 2, int) == 2
    assert path.is_dir() and list(tmp_path.glob("*.part")) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_a_write_that_fails_computes_and_leaves_no_part(tmp_path, monkeypatch, code):
    # A full disk fails half-way through the write; a read-only folder (EROFS, or EACCES
    # where the user is not root) fails when the .part is made.
    monkeypatch.setenv(stored.ENV, str(tmp_path))

    def full(value, out):
        out.write(b"half")
        raise OSError(code, os.strerror(code))

    def read_only(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as m:
        if code == errno.ENOSPC:
            m.setattr(stored.pickle, "dump", full)
        else:
            m.setattr(stored.tempfile, "NamedTemporaryFile", read_only)
        assert stored.kept("k", (1,), lambda: 1, int) == 1
    assert list(tmp_path.glob("*.part")) == [] and list(tmp_path.glob("*.pickle")) == []
    assert stored.kept("k", (1,), lambda: 2, int) == 2  # nothing was kept: computed


def _slow_square(folder, x, out):
    import os
    import time

    os.environ[stored.ENV] = folder

    def compute():
        time.sleep(0.5)
        with open(out, "a") as f:
            f.write("computed\n")
        return x * x

    return stored.kept("square", (x,), compute, int)


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


def test_a_policy_of_every_op_on_an_accelerator_is_kept_per_accelerator(tmp_path, monkeypatch):
    # The pages of one GPU build ask for the live CUDA policy more than once (autocast/plot_02,
    # plot_04): the first computes, the others read. Here the probe is a counter and the GPU a
    # name, so the cache's own code runs on the CPU.
    monkeypatch.setenv(stored.ENV, str(tmp_path))
    gpu = device.Target(torch.device("cuda"), simulated=False)
    probed = []

    def fake_probe(target, dtype, ops, seed):
        probed.append((target.device.type, dtype))
        return policy.Policy("cuda", dtype, device.describe("cpu"), (), device.LIVE)

    monkeypatch.setattr(policy, "_probe", fake_probe)
    for name in ("GPU A", "GPU A", "GPU B"):
        machine = device.Machine("cuda", name, torch.__version__, "CUDA 13.0")
        monkeypatch.setattr(policy._device, "describe", lambda dev, m=machine: m)
        assert policy.probe(gpu, torch.bfloat16).dtype == torch.bfloat16
    assert probed == [("cuda", torch.bfloat16)] * 2  # GPU A once, GPU B once
    policy.probe(gpu, torch.float16)
    policy.probe(gpu, torch.bfloat16, ops=policy.registered()[:1])  # chosen ops: not kept
    assert len(probed) == 4 and len(list(tmp_path.glob("policy-*.pickle"))) == 3
