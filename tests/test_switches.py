import warnings

import pytest
import torch

from mpguide import MPGuideError
from mpguide.core import state, switches


def test_precision_restores_every_switch_it_touched_even_when_the_body_raises():
    before = state.snapshot()
    settings = {
        switches.MATMUL_PRECISION: "medium",
        "cudnn.allow_tf32": False,
        "fp32_precision": "tf32",
        "mkldnn.conv.fp32_precision": "bf16",
    }
    with pytest.raises(RuntimeError, match="boom"), switches.precision(settings):
        assert state.get("mkldnn.conv.fp32_precision") == "bf16"
        assert state.get("cudnn.conv.fp32_precision") == "tf32"
        raise RuntimeError("boom")
    assert state.snapshot() == before
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_bad_setting_is_one_line_and_leaves_nothing_behind():
    before = state.snapshot()
    with (
        pytest.raises(MPGuideError, match="does not support precision 'bf16'"),
        switches.precision({"fp32_precision": "tf32", "cuda.matmul.fp32_precision": "bf16"}),
    ):
        pass
    assert state.snapshot() == before
    with pytest.raises(MPGuideError, match=r"has no switch torch\.backends\.cuda\.conv"):
        switches.apply("cuda.conv.fp32_precision", "tf32")
    with pytest.raises(MPGuideError, match="highest, high, medium"):
        switches.apply(switches.MATMUL_PRECISION, "low")


def test_legacy_reads_report_the_mixed_api_error():
    with switches.precision({"cuda.matmul.fp32_precision": "tf32"}):
        reads = switches.legacy()
    assert reads["cuda.matmul.allow_tf32"] == "raises RuntimeError"
    assert switches.legacy()["cuda.matmul.allow_tf32"] == "False"


def test_change_records_what_a_legacy_call_writes():
    ch = switches.change(switches.MATMUL_PRECISION, "medium")
    assert ch.call == "torch.set_float32_matmul_precision('medium')"
    assert ("mkldnn.matmul.fp32_precision", "none", "bf16") in ch.changed
    assert dict(ch.legacy)["torch.get_float32_matmul_precision()"] == "medium"
    assert torch.get_float32_matmul_precision() == "highest"
    assert ch.wrote("mkldnn.matmul.fp32_precision") == "bf16" and ch.wrote("fp32_precision") is None
    both = switches.changes([("cuda.matmul.allow_tf32", True), ("fp32_precision", "ieee")])
    assert both["torch.backends.fp32_precision = 'ieee'"].wrote("cuda.matmul.fp32_precision")
    assert both.writes().records()[0] == {
        "call": "cuda.matmul.allow_tf32 = True",
        "switch": "cuda.matmul.fp32_precision",
        "change": "none -> tf32",
    }
    assert both.reads().column("warnings") == ["none", "none"]
    tab = both.reads()
    assert tab.column("call") == [
        "cuda.matmul.allow_tf32 = True",
        "fp32_precision = 'ieee'",
    ]


def test_change_records_warnings(monkeypatch):
    put = state.put

    def warning_put(path, value):
        warnings.warn(f"setting {path}", UserWarning, stacklevel=2)
        put(path, value)

    assert switches.change("cudnn.allow_tf32", False).warnings == ()
    monkeypatch.setattr(state, "put", warning_put)
    ch = switches.change("cudnn.allow_tf32", False)
    assert ch.warnings == ("setting cudnn.allow_tf32",)
    assert ch.wrote("cudnn.conv.fp32_precision") == "none"


def _cpu_has_reduced_precision_units() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "amx_tile"))


@pytest.mark.skipif(_cpu_has_reduced_precision_units(), reason="this CPU has bf16 units")
@pytest.mark.parametrize(
    "settings",
    [
        {"fp32_precision": "tf32"},
        {"mkldnn.matmul.fp32_precision": "bf16"},
        {switches.MATMUL_PRECISION: "medium"},
    ],
)
def test_detector_sees_no_effect_on_a_cpu_without_reduced_precision_units(settings):
    eff = switches.effect(settings, "cpu")
    assert eff.reproducible and eff.changed == ()
    assert "no effect on this hardware" in repr(eff)


def test_detector_sees_a_change():
    eff = switches.Effect(
        (("fp32_precision", "tf32"),), "cuda", (("matmul", 1e-3), ("conv2d", 0.0)), True
    )
    assert eff.changed == ("matmul",)
    assert "changes matmul" in repr(eff) and "<code>" in eff._repr_html_()


def test_no_warning_or_state_left_by_the_detector():
    before = state.snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        switches.effect({"fp32_precision": "bf16"}, "cpu")
    assert state.snapshot() == before


@pytest.mark.gpu
def test_tf32_switch_changes_cuda_matmul_on_ampere_or_later():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability 8.0")
    eff = switches.effect({"cuda.matmul.fp32_precision": "tf32"}, "cuda")
    assert "matmul" in eff.changed
