import pytest
import torch

from mpguide import MPGuideError
from mpguide.core import dtypes
from mpguide.precision import formats
from mpguide.traces import casts


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.float16", torch.float16),
        ("HALF", torch.float16),
        ("fp32", torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_dtype_names(name, expected):
    assert dtypes.parse(name) is expected


def test_unknown_dtype_names_the_choices():
    with pytest.raises(MPGuideError, match=r"unknown dtype 'int8'; choose one of .*bfloat16"):
        dtypes.parse("int8")


def test_names_short_and_long():
    assert dtypes.name(torch.bfloat16) == "bfloat16"
    assert [dtypes.short(d) for d in (torch.float32, torch.bfloat16, torch.int64)] == [
        "f32",
        "bf16",
        "i64",
    ]
    assert dtypes.short(torch.float8_e4m3fn) == "float8_e4m3fn"


def test_autocast_dtype_refuses_float32():
    with pytest.raises(MPGuideError, match="autocast takes bfloat16 or float16, not float32"):
        dtypes.autocast_dtype("fp32")


def test_autocast_dtype_names_only_what_autocast_takes_for_an_unknown_name():
    expected = r"^unknown dtype 'int8'; autocast takes bfloat16 or float16$"
    with pytest.raises(MPGuideError, match=expected):
        dtypes.autocast_dtype("int8")


def test_formats_take_the_same_aliases():
    assert formats.get("BF16").name == "bfloat16"
    assert formats.get("torch.half").name == "float16"
    assert formats.get("tf32").name == "tf32"


def test_source_index_names_the_converted_argument():
    assert dtypes.source_index("aten.copy_.default") == 1
    assert dtypes.source_index("aten._to_copy.default") == 0
    assert dtypes.source_index("aten.mm.default") is None


def test_log_sees_autocasts_conversions():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with dtypes.Log() as log, torch.autocast("cpu", dtype=torch.bfloat16):
        a @ b
    assert log.conversions() == [(torch.float32, torch.bfloat16)] * 2
    assert [c.op for c in log.calls][-1] == "aten.mm.default"


def test_the_cast_report_counts_the_same_ops_as_the_log():
    packets = {c.rsplit(".", 1)[0] if c.count(".") == 2 else c for c in dtypes.CONVERSIONS}
    for op in casts.CAST_OPS:
        assert op.replace("::", ".") in packets, op


def test_log_puts_keyword_tensors_such_as_out_last():
    a, out = torch.ones(3, dtype=torch.bfloat16), torch.empty(3)
    with dtypes.Log() as log:
        torch.add(a, a, out=out)
    (call,) = [c for c in log.calls if c.op.startswith("aten.add")]
    assert call.ins == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert call.out == torch.float32
