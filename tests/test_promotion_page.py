"""examples/autocast/plot_04 renders a probe whose process died as a row that says so."""

import dataclasses
import runpy

import pytest
from helpers import ROOT

from mpguide.autocast import isolated, policy

PAGE = ROOT / "examples" / "autocast" / "plot_04_promotion_vs_autocast.py"


@pytest.mark.slow
def test_a_probe_that_died_on_the_gpu_is_a_row_not_a_crash(monkeypatch):
    across = policy.across
    # The op whose probe died on the H100 (docs/recorded/nvidia-h100-80gb-hbm3.json).
    dead = "_grid_sampler_2d_cpu_fallback"

    def with_a_dead_probe(dtype, devices):
        found = across(dtype, devices)
        cuda = found["cuda"]
        op = next(op for op in policy.registered() if op.name == dead)
        died = isolated.crashed(op, "cuda:0", "SIGSEGV", "Fatal Python error: Segmentation fault")
        probes = tuple(died if p.op == dead else p for p in cuda.probes)
        cuda = dataclasses.replace(cuda, probes=probes)
        return dataclasses.replace(found, policies=(found["cpu"], cuda))

    monkeypatch.setattr(policy, "across", with_a_dead_probe)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("MPGUIDE_RECORDED", raising=False)
    page = runpy.run_path(str(PAGE))
    row = next(r for r in page["table"].rows if r[0] == dead)
    assert row[4] == "probe died"
    assert row[5] == (
        "probe died: SIGSEGV (Fatal Python error: Segmentation fault), running this op on cuda:0"
    )
