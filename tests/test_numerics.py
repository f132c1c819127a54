import math

import pytest
import torch

from mpguide import MPGuideError
from mpguide.precision import numerics

SHAPE = (32, 512, 24)


def test_error_statistics_on_known_inputs():
    ref = torch.tensor([1.0, -2.0, 3.0, -6.0], dtype=torch.float64)
    approx = ref + torch.tensor([0.5, 0.0, -1.5, 0.0], dtype=torch.float64)
    stats = numerics.errors(approx.float(), ref)
    assert stats.max_abs == 1.5
    assert stats.max_rel == 1.5 / 3.0
    assert stats.rms == math.sqrt((0.25 + 2.25) / 4)
    assert stats.mean == -0.25
    assert "max |error| 1.5" in repr(stats)


def test_error_statistics_reject_bad_input():
    with pytest.raises(MPGuideError, match="shapes differ"):
        numerics.errors(torch.zeros(3), torch.zeros(4))
    with pytest.raises(MPGuideError, match="no values"):
        numerics.errors(torch.zeros(0), torch.zeros(0))


def test_relative_error_against_zeros_is_zero_or_infinite():
    assert numerics.errors(torch.zeros(3), torch.zeros(3)).max_rel == 0
    assert numerics.errors(torch.tensor([0.0, 1e-3]), torch.zeros(2)).max_rel == float("inf")


@pytest.fixture(scope="module")
def cpu_table():
    return numerics.matmul_errors([SHAPE], dev="cpu", repeats=1)


def test_cpu_table_emulates_low_precision_and_flags_dead_switches(cpu_table):
    fp32 = cpu_table.row("fp32")
    assert fp32.how == numerics.HARDWARE and fp32.seconds > 0
    for mode in ("tf32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
        row = cpu_table.row(mode)
        assert row.how == numerics.EMULATED and row.seconds is None and row.tflops is None
    switch_rows = [r for r in cpu_table.rows if r.mode.startswith("fp32_precision=")]
    assert {r.mode for r in switch_rows} == set(numerics.switch_modes(torch.device("cpu")))
    # The CPU has no TF32: the switch is accepted and changes no bit.
    assert cpu_table.row("fp32_precision=tf32").how == numerics.NO_EFFECT


def test_a_hardware_path_that_fails_is_emulated_and_says_why(monkeypatch, caplog):
    real = numerics._hardware

    def failing(mode, a, b):
        return real(mode, a, b) if mode.startswith("fp32") else "torch._scaled_mm raised X"

    monkeypatch.setattr(numerics, "_hardware", failing)
    table = numerics.matmul_errors([(4, 8, 2)], ["bfloat16"], dev="cpu", repeats=1)
    row = table.row("bfloat16")
    assert row.how == f"{numerics.EMULATED}: torch._scaled_mm raised X"
    assert "bfloat16 at (4, 8, 2) emulated because torch._scaled_mm raised X" in caplog.text


def test_error_ordering_follows_the_mantissa_widths(cpu_table):
    rel = {r.mode: r.stats.max_rel for r in cpu_table.rows}
    assert rel["fp32"] * 100 < rel["tf32"]
    assert rel["tf32"] * 3 < rel["bfloat16"]
    assert math.isclose(rel["tf32"], rel["float16"], rel_tol=0.05)
    assert rel["bfloat16"] < rel["float8_e4m3fn"] < rel["float8_e5m2"]


def test_table_renders_every_row(cpu_table):
    tab = cpu_table.table()
    assert len(tab.rows) == len(cpu_table.rows)
    assert "emulated" in tab.to_html() and "32 x 512 x 24" in repr(cpu_table)
    with pytest.raises(MPGuideError, match="0 rows"):
        cpu_table.row("float16", (1, 2, 3))


def test_matmul_errors_rejects_unknown_modes():
    with pytest.raises(MPGuideError, match="unknown format 'fp12'"):
        numerics.matmul_errors([SHAPE], ("fp32", "fp12"), dev="cpu")


def test_accumulating_in_the_format_rounds_every_partial_sum():
    a = torch.tensor([[1.0, 2.0**-9, 2.0**-9]])
    b = torch.ones(3, 1)
    # In bf16, 1 + 2^-9 rounds back to 1 each time; fp32 accumulation keeps both halves.
    assert numerics.accumulate(a, b, "bfloat16").item() == 1.0
    assert (a @ b).item() == 1 + 2.0**-8


def test_k_sweep_error_growth():
    ks = [16, 256, 4096]
    sweep = numerics.k_sweep(ks, dev="cpu", m=8, n=8)
    assert sweep.curves()[0] == ("float32", "fp32")
    for fmt, acc in sweep.curves():
        got, stats = sweep.series(fmt, acc)
        assert got == ks and all(s.max_rel > 0 for s in stats)
    _, bf16_acc = sweep.series("bfloat16", "bfloat16")
    _, bf16_fp32 = sweep.series("bfloat16", "fp32")
    assert bf16_acc[-1].max_rel > 10 * bf16_acc[0].max_rel
    assert bf16_acc[-1].max_rel > 10 * bf16_fp32[-1].max_rel
    assert bf16_fp32[-1].rms > 5 * bf16_fp32[0].rms
    tab = sweep.table()
    assert tab.column("K") == ks
    assert tab.column("bfloat16, bfloat16 acc.") == [s.max_rel for s in bf16_acc]
    with pytest.raises(MPGuideError, match="no rows"):
        sweep.series("float16", "float32")


def test_k_sweep_rejects_bad_lengths():
    with pytest.raises(MPGuideError, match="positive"):
        numerics.k_sweep([0, 16], dev="cpu")


@pytest.mark.gpu
def test_cuda_table_measures_the_hardware():
    table = numerics.matmul_errors([(256, 1024, 256)], dev="cuda", repeats=2)
    for mode in ("fp32", "bfloat16", "float16"):
        row = table.row(mode)
        assert row.how == numerics.HARDWARE and row.seconds > 0 and row.tflops > 0
    assert table.row("tf32").how in (numerics.HARDWARE, numerics.NO_EFFECT)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert table.row("float8_e4m3fn").how == numerics.HARDWARE
        e5m2 = table.row("float8_e5m2").how  # e5m2 x e5m2 is refused by _scaled_mm on Hopper
        assert e5m2 == numerics.HARDWARE or e5m2.startswith(
            f"{numerics.EMULATED}: torch._scaled_mm"
        )
