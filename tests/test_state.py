import pytest
import torch

from mpguide.core import state


def _flip_everything():
    torch.backends.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.set_float32_matmul_precision("medium")
    torch.set_default_dtype(torch.float64)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    import torch._inductor.config as inductor

    inductor.emulate_precision_casts = not inductor.emulate_precision_casts


def test_preserved_restores_every_switch_even_when_the_body_raises():
    before = state.snapshot()
    with pytest.raises(RuntimeError, match="boom"), state.preserved():
        _flip_everything()
        assert state.snapshot() != before
        raise RuntimeError("boom")
    assert state.snapshot() == before
    assert torch.get_default_dtype() == torch.float32
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_the_snapshot_sees_each_switch_change():
    before = state.snapshot()
    with state.preserved():
        torch.set_float32_matmul_precision("high")
        changed = {k for k, v in state.snapshot().items() if before[k] != v}
    assert "backends.cuda.matmul.fp32_precision" in changed


def test_reset_seeds_and_restores():
    pristine = state.snapshot()
    torch.set_default_dtype(torch.float64)
    state.reset(pristine, value=3)
    a = torch.rand(3)
    state.reset(pristine, value=3)
    assert torch.equal(a, torch.rand(3))
    assert torch.get_default_dtype() == torch.float32


def test_get_and_put_by_path():
    with state.preserved():
        state.put("cuda.matmul.fp32_precision", "tf32")
        assert state.get("cuda.matmul.fp32_precision") == "tf32"
    assert not state.available("no.such.switch")


def test_restore_brings_back_the_legacy_values_kept_beside_the_tree():
    before = state.snapshot()
    assert before["legacy.float32_matmul_precision"] == "highest"
    with state.preserved():
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = False
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cudnn.allow_tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 is False
    assert state.snapshot() == before


def test_a_mixed_state_is_recorded_not_raised():
    with state.preserved():
        torch.backends.fp32_precision = "tf32"
        snap = state.snapshot()
    assert snap["legacy.float32_matmul_precision"] == state.MIXED
    assert torch.get_float32_matmul_precision() == "highest"
