import warnings

import pytest
import torch
from helpers import ROOT

from mpguide.core import dtypes, versions


def test_release_reads_major_and_minor_of_any_build():
    assert versions.release("2.14.1+cu130") == (2, 14)
    assert versions.release("2.11.0") == (2, 11)
    assert versions.release("2.13.0a0+git1234") == (2, 13)
    assert versions.release("2.9") < versions.release("2.10")  # numbers, not strings
    with pytest.raises(ValueError, match="not a torch version"):
        versions.release("nightly")


def test_the_running_torch_is_inside_the_window():
    oldest, newest = (versions.release(v) for v in versions.WINDOW)
    assert oldest <= versions.release() <= newest
    assert versions.at_least(versions.WINDOW[0])


def test_at_least_compares_releases_with_the_running_torch():
    major, minor = versions.release()
    assert versions.at_least(f"{major}.{minor}")
    assert versions.at_least(f"{major}.{minor - 1}")
    assert not versions.at_least(f"{major}.{minor + 1}")


def test_a_change_states_the_side_of_the_running_torch():
    major, minor = versions.release()
    new = versions.Change("x", f"{major}.{minor}", "old way", "new way")
    future = versions.Change("x", f"{major}.{minor + 1}", "old way", "new way")
    assert new.holds and new.now == "new way"
    assert new.describe().startswith(f"since torch {major}.{minor}: new way")
    assert not future.holds and future.now == "old way"
    assert future.describe().startswith(f"before torch {major}.{minor + 1}: old way")


def test_every_change_happened_inside_the_window_and_says_both_sides():
    oldest, newest = (versions.release(v) for v in versions.WINDOW)
    assert versions.CHANGES
    for name, c in versions.CHANGES.items():
        assert c.name == name and versions.change(name) is c
        # A change at the oldest release holds everywhere in the window: nothing to state.
        assert oldest < versions.release(c.since) <= newest, name
        assert c.before and c.after and c.before != c.after, name


def test_the_package_and_the_readme_state_the_window():
    root = ROOT
    oldest, newest = versions.WINDOW
    assert f'dependencies = ["torch>={oldest}",' in (root / "pyproject.toml").read_text()
    assert f"Supported torch: {oldest} to {newest}," in (root / "README.md").read_text()


def test_an_unknown_change_is_a_key_error():
    with pytest.raises(KeyError):
        versions.change("no such change")


# -- each fact, checked on the running torch ----------------------------------------------------


def _raises(fn) -> bool:
    try:
        fn()
    except Exception:  # noqa: BLE001 -- whether it raises is the fact
        return True
    return False


def test_rms_norm_cuda_autocast():
    table = torch._C._dispatch_dump_table("aten::rms_norm")
    has_rule = "AutocastCUDA: registered at" in table
    assert has_rule is versions.change("rms_norm_cuda_autocast").holds


def test_addmv_cpu_mixed_bias():
    bias, mat, vec = torch.ones(4, dtype=torch.bfloat16), torch.ones(4, 3), torch.ones(3)
    if versions.change("addmv_cpu_mixed_bias").holds:
        assert _raises(lambda: torch.addmv(bias, mat, vec))
    else:
        assert torch.addmv(bias, mat, vec).dtype == torch.float32


def test_quantile_fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(64)
        if versions.change("quantile_fake_tensor").holds:
            assert torch.quantile(x, 0.5).dtype == torch.float32
        else:
            assert _raises(lambda: torch.quantile(x, 0.5))


def test_quantile_internal_float64():
    log = dtypes.Log()
    with log:
        torch.quantile(torch.rand(64), 0.5)
    via_float64 = {(torch.float32, torch.float64), (torch.float64, torch.float32)}
    assert (set(log.conversions()) == via_float64) is versions.change(
        "quantile_internal_float64"
    ).holds


def test_profiler_acc_events():
    from torch.profiler import ProfilerActivity, profile

    def warned(**kwargs) -> bool:
        torch.profiler.profiler._WARNINGS_SHOWN.clear()  # torch warns once per process
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with profile(activities=[ProfilerActivity.CPU], **kwargs):
                torch.ones(2) + 1
        return bool(caught)

    assert not warned(acc_events=True)  # what mpguide passes, on every release of the window
    assert warned() is not versions.change("profiler_acc_events").holds
