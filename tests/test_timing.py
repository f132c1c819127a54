import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mpguide import MPGuideError
from mpguide.core import timing


class FakeClock:
    """Each call returns the next reading; every call is logged with the synchronisations."""

    def __init__(self, durations, log):
        self.readings = itertools.chain.from_iterable((0.0, d) for d in durations)
        self.log = log

    def __call__(self):
        self.log.append("clock")
        return next(self.readings)


def test_samples_are_clock_differences_between_synchronisations():
    log = []
    clock = FakeClock([0.004, 0.001, 0.002, 0.003, 0.005], log)
    lat = timing.measure(
        lambda: log.append("call"),
        "cpu",
        label="f",
        warmup=2,
        repeat=5,
        items=8,
        clock=clock,
        sync=lambda: log.append("sync"),
    )
    assert lat.times == (0.004, 0.001, 0.002, 0.003, 0.005)
    assert lat.median == pytest.approx(0.003)
    assert lat.quartiles == pytest.approx((0.002, 0.004))
    assert lat.spread == pytest.approx(0.004 - 0.002)
    assert lat.throughput == pytest.approx(8 / 0.003)
    assert log[:3] == ["call", "call", "sync"]
    assert log[3:9] == ["sync", "clock", "call", "sync", "clock", "sync"]
    assert log.count("call") == 7


def test_rounds_are_interleaved():
    order = []
    durations = [1.0] * 6
    timing.compare_latency(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")},
        "cpu",
        warmup=0,
        repeat=3,
        clock=FakeClock(durations, []),
        sync=lambda: None,
    )
    assert order == ["a", "b"] * 3


def test_noise_and_few_samples_are_flagged():
    steady = timing.Latency("steady", (1.0, 1.01, 0.99, 1.0, 1.0, 1.02), "cpu")
    noisy = timing.Latency("noisy", (1.0, 2.0, 1.0, 3.0, 1.0, 2.5), "cpu")
    assert steady.warnings == ()
    assert any(w.startswith("noisy") for w in noisy.warnings)
    assert "warning: noisy" in repr(noisy)
    assert timing.Latency("one", (1.0,), "cpu").warnings == ("only 1 samples",)


def test_clearly_below_needs_a_gap_larger_than_the_spreads():
    fast = timing.Latency("fast", (1.0, 1.1, 0.9, 1.0, 1.0), "cpu")
    slow = timing.Latency("slow", (2.0, 2.1, 1.9, 2.0, 2.0), "cpu")
    near = timing.Latency("near", (1.05, 1.2, 0.95, 1.1, 1.0), "cpu")
    assert fast.clearly_below(slow) and not slow.clearly_below(fast)
    assert not fast.clearly_below(near)


def test_bad_arguments_raise_one_line_errors():
    with pytest.raises(MPGuideError, match="repeat >= 1"):
        timing.measure(lambda: None, "cpu", repeat=0)
    with pytest.raises(MPGuideError, match="nothing to time"):
        timing.compare_latency({}, "cpu")
    with pytest.raises(MPGuideError, match="no samples"):
        timing.Latency("empty", (), "cpu")


def test_real_clock_measures_something():
    x = torch.randn(64, 64)
    lat = timing.measure(lambda: x @ x, "cpu", warmup=1, repeat=5)
    assert len(lat.times) == 5 and all(t > 0 for t in lat.times)
    table = timing.latency_table({"mm": lat})
    assert table.column("runs") == [5]


def test_cpu_peak_counts_live_tensors_only():
    n = 256 * 256 * 4  # bytes of one float32 256 x 256 tensor

    def two_alive():
        a = torch.ones(256, 256)
        b = torch.ones(256, 256)
        return a, b

    def one_at_a_time():
        for _ in range(3):
            torch.ones(256, 256)

    assert timing.peak_memory(two_alive, "cpu").peak_bytes == 2 * n
    one = timing.peak_memory(one_at_a_time, "cpu")
    assert one.peak_bytes == n
    assert one.method == "profiler allocation events" and "MiB" in repr(one)


def test_cpu_peak_of_bf16_is_half_of_fp32():
    def make(dt):
        return lambda: torch.zeros(512, 512, dtype=dt)

    fp32 = timing.peak_memory(make(torch.float32), "cpu").peak_bytes
    bf16 = timing.peak_memory(make(torch.bfloat16), "cpu").peak_bytes
    assert fp32 == 2 * bf16 == 512 * 512 * 4


@pytest.mark.gpu
def test_cuda_peak_and_synchronised_latency():
    dev = torch.device("cuda")
    peak = timing.peak_memory(lambda: torch.ones(1024, 1024, device=dev), dev)
    assert peak.peak_bytes == 1024 * 1024 * 4
    x = torch.randn(1024, 1024, device=dev)
    lat = timing.measure(lambda: x @ x, dev, warmup=2, repeat=5)
    assert lat.device == "cuda" and lat.median > 0


samples = st.lists(st.floats(1e-6, 10.0, allow_nan=False), min_size=1, max_size=40)


@given(samples, samples)
def test_statistics_are_ordered_and_clearly_below_is_one_way(a, b):
    la, lb = timing.Latency("a", tuple(a), "cpu", 2), timing.Latency("b", tuple(b), "cpu", 2)
    q1, q3 = la.quartiles
    assert min(a) <= q1 <= la.median <= q3 <= max(a)
    assert la.spread >= 0 and la.throughput == pytest.approx(2 / la.median)
    assert not (la.clearly_below(lb) and lb.clearly_below(la))
    assert not la.clearly_below(la)
