"""A probe whose child process dies comes back as a row that says so, never as ``None``."""

import textwrap

import pytest
import torch

from mpguide.autocast import catalogue, isolated, policy

# Planted in the child through a sitecustomize module on its PYTHONPATH: when the op named by
# MPGUIDE_TEST_DIE_ON is probed, the child dies the way MPGUIDE_TEST_DIE_HOW says.
SITECUSTOMIZE = textwrap.dedent(
    """
    import os, signal, time
    from mpguide.autocast import catalogue, probing

    def no_ops():
        raise RuntimeError("no device for the probe")

    if os.environ.get("MPGUIDE_TEST_DIE_HOW") == "at-start":
        catalogue.ops = no_ops
    _probe_op = probing.probe_op

    def probe_op(op, *args, **kwargs):
        if op.name != os.environ.get("MPGUIDE_TEST_DIE_ON"):
            return _probe_op(op, *args, **kwargs)
        how = os.environ["MPGUIDE_TEST_DIE_HOW"]
        if how == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if how == "abort":
            os.abort()
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(600)
        if how == "device-side assert":
            run = probing.Run(None, (), "AcceleratorError: CUDA error: device-side assert triggered")
            return probing.Probe(op.name, op.family, probing.UNSUPPORTED, run, run, None)
        raise AssertionError(how)

    probing.probe_op = probe_op
    """
)


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """Three catalogue ops with two floating inputs each; the child dies on the second."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    ops = [op for op in catalogue.ops() if op.name in ("addcmul", "atan2", "bmm")]
    assert [op.name for op in ops] == ["addcmul", "atan2", "bmm"]
    monkeypatch.setenv("MPGUIDE_TEST_DIE_ON", "atan2")

    def probe(how: str, **kwargs):
        monkeypatch.setenv("MPGUIDE_TEST_DIE_HOW", how)
        return isolated.probe_ops(ops, "cpu", torch.bfloat16, **kwargs)

    return probe


def _alive(probes):
    """The ops before and after the dead one were probed as in this process."""
    ops = [op for op in catalogue.ops() if op.name in (probes[0].op, probes[2].op)]
    direct = policy.probe("cpu", torch.bfloat16, ops).probes
    for p, want in zip((probes[0], probes[2]), direct, strict=True):
        assert p.died is None
        assert (p.kind, p.fp32_in, p.low_in, p.mixed_in) == (
            want.kind,
            want.fp32_in,
            want.low_in,
            want.mixed_in,
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("segfault", "probe died: SIGSEGV (Fatal Python error: Segmentation fault; at "),
        ("abort", "probe died: SIGABRT (Fatal Python error: Aborted; at "),
        ("killed", "probe died: SIGKILL, running this op on cpu"),
    ],
)
def test_a_probe_that_dies_is_a_row_that_says_how(planted, how, said):
    probes = planted(how)
    assert [p.op for p in probes] == ["addcmul", "atan2", "bmm"]
    dead = probes[1]
    assert dead.died is not None and dead.died.startswith(said), dead.died
    assert dead.note == dead.died and dead.kind == policy.UNSUPPORTED
    # every run is there, the mixed one too (atan2 takes two floating inputs): no None
    for run in (dead.fp32_in, dead.low_in, dead.mixed_in):
        assert run is not None and run.error == dead.died and run.out is None
    _alive(probes)


@pytest.mark.slow
def test_an_op_that_breaks_the_device_is_listed_and_a_fresh_child_goes_on(planted):
    probes = planted("device-side assert")
    assert probes[1].died == (
        "probe died: the device broke (AcceleratorError: CUDA error: device-side assert "
        "triggered), running this op on cpu"
    )
    _alive(probes)


@pytest.mark.slow
def test_a_child_that_gives_no_answer_is_killed(planted):
    probes = planted("hang", timeout=20)
    assert probes[1].died.startswith("probe died: no answer in 20 s, killed"), probes[1].died
    _alive(probes)


@pytest.mark.slow
def test_a_child_that_dies_before_its_first_op_takes_every_op_with_it(planted):
    probes = planted("at-start")
    said = (
        "probe died: exit status 1 before its first op (RuntimeError: no device for the "
        "probe), running this op on cpu"
    )
    assert [p.died for p in probes] == [said] * 3


def test_last_words_name_the_fatal_error_and_where():
    stderr = (
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x7f (most recent call first):\n"
        '  File "/x/mpguide/autocast/catalogue.py", line 135 in <lambda>\n'
        '  File "/x/mpguide/autocast/probing.py", line 73 in _call\n\n'
        "Extension modules: numpy, torch (total: 2)\n"
    )
    assert isolated.last_words(stderr) == (
        "Fatal Python error: Segmentation fault; at catalogue.py:135"
    )
    assert isolated.last_words("warming up\nRuntimeError: CUDA error: x\nbye\n") == (
        "RuntimeError: CUDA error: x"
    )
    assert isolated.last_words("one\ntwo\n") == "two"
    assert isolated.last_words("") == ""
    assert len(isolated.last_words("E" * 500)) == 200
