import pytest
import torch

from mpguide import MPGuideError
from mpguide.training import casting

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    ("method", "same"),
    [("construct", True), ("to", True), ("data", True), ("overwrite", False), ("swap", True)],
)
def test_casting_methods_identity_dtype_and_no_backward_cast(method, same):
    c = casting.convert(method, BF16, "cpu")
    assert c.same_object is same
    assert (c.dtype, c.recorded, c.grad) == (BF16, BF16, BF16)
    assert c.old_grad == (BF16 if same else None)
    assert c.backward_casts == 0 and c.error == ""
    assert not torch.__future__.get_overwrite_module_params_on_conversion()
    assert not torch.__future__.get_swap_module_params_on_conversion()


@pytest.mark.parametrize(
    ("method", "grad", "old_grad", "error"),
    [
        ("to", FP32, FP32, ""),
        ("data", FP32, FP32, ""),
        ("overwrite", None, FP32, ""),
        ("swap", None, None, "poisoned by swap_tensors"),
    ],
)
def test_casting_after_the_forward_keeps_the_recorded_fp32(method, grad, old_grad, error):
    c = casting.convert(method, BF16, "cpu", graph_before=True)
    assert (c.dtype, c.recorded) == (BF16, FP32)
    assert (c.grad, c.old_grad) == (grad, old_grad)
    assert error in c.error and bool(c.error) == bool(error)
    assert c.backward_casts == 0
    assert not torch.__future__.get_swap_module_params_on_conversion()


def test_conversions_table_and_bad_method():
    table = casting.conversions(BF16, "cpu", graph_before=True)
    assert len(table.rows) == len(casting.METHODS) - 1
    assert "forward before the cast" in table.caption
    assert table.column("backward") == ["0 casts", "0 casts", "0 casts", "raised"]
    assert len(table.notes) == 1 and "swap flag: backward raised: " in table.notes[0]
    with pytest.raises(MPGuideError, match="unknown method"):
        casting.convert("cast-harder")


@pytest.mark.parametrize("method", ["overwrite", "swap"])
def test_future_flags_restored_when_the_cast_raises(monkeypatch, method):
    def boom(self, *args, **kwargs):
        assert torch.__future__.get_overwrite_module_params_on_conversion() or (
            torch.__future__.get_swap_module_params_on_conversion()
        )
        raise RuntimeError("cast failed")

    monkeypatch.setattr(torch.nn.Module, "to", boom)
    with pytest.raises(RuntimeError, match="cast failed"):
        casting.convert(method, BF16, "cpu")
    assert not torch.__future__.get_overwrite_module_params_on_conversion()
    assert not torch.__future__.get_swap_module_params_on_conversion()
