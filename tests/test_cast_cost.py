import dataclasses

import pytest
import torch

from mpguide.autocast import catalogue, isolated, policy
from mpguide.traces import cast_cost


def test_norm_upcasts_counts_the_casts_of_each_norm_on_the_cpu():
    table = cast_cost.norm_upcasts("cpu", rows=8, features=64, steps=2)
    rows = {(r[0], r[1]): dict(zip(table.columns, r, strict=True)) for r in table.rows}
    assert list(rows) == [
        ("LayerNorm", "autocast"),
        ("LayerNorm", "float32 by hand"),
        ("RMSNorm", "autocast"),
        ("RMSNorm", "float32 by hand"),
    ]
    # CPU autocast leaves layer_norm alone: bf16 in, bf16 out, no cast
    assert rows[("LayerNorm", "autocast")]["casts/call"] == 0
    assert rows[("LayerNorm", "autocast")]["upcast us"] is None
    for norm in ("LayerNorm", "RMSNorm"):
        by_hand = rows[(norm, "float32 by hand")]
        assert by_hand["casts/call"] == 2 and by_hand["output"] == "bf16"
        assert by_hand["norm op us"] > 0 and by_hand["upcast us"] > 0
        assert by_hand["downcast us"] > 0


def test_cast_bandwidth_counts_the_bytes_each_cast_moves():
    pairs = ((torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn))
    table = cast_cost.cast_bandwidth("cpu", sizes=(4096,), pairs=pairs, repeat=3)
    assert [r[0] for r in table.rows] == ["f32 -> bf16", "f32 -> float8_e4m3fn"]
    assert [r[2] for r in table.rows] == [4096 * 6, 4096 * 5]
    for row in table.rows:
        us, rate, copy = row[3], row[4], row[5]
        assert us > 0 and copy > 0
        assert rate == pytest.approx(row[2] / us / 1e3)


@pytest.mark.slow
def test_an_op_that_ends_the_probing_process_is_listed_and_the_probe_goes_on():
    ops = catalogue.ops()
    gone = dataclasses.replace(ops[1], name="not_an_op")  # the child cannot find it, and exits
    chosen = [ops[0], gone, ops[2]]
    probes = isolated.probe_ops(chosen, "cpu", torch.bfloat16)
    assert [p.op for p in probes] == [ops[0].name, "not_an_op", ops[2].name]
    assert probes[1].kind == policy.UNSUPPORTED
    assert probes[1].died.startswith("probe died: exit status 1 (KeyError")
    direct = policy.probe("cpu", torch.bfloat16, [ops[0], ops[2]])
    assert [(p.kind, p.fp32_in, p.low_in) for p in (probes[0], probes[2])] == [
        (p.kind, p.fp32_in, p.low_in) for p in direct.probes
    ]
