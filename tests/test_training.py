"""Tests of mpguide.training."""

import json

import pytest
import torch

from mpguide import MPGuideError, training

# --- Loss scaling, optimizer precision, whole training loops ---


# --- Layers with state, recompute, communication dtypes ---


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def test_norms_follow_each_devices_autocast():
    norms = training.norms("bf16", devices=("cpu", "cuda"), layers=("BatchNorm1d", "LayerNorm"))
    bn, ln = norms["BatchNorm1d", "cpu"], norms["LayerNorm", "cpu"]
    assert (bn.computes, bn.out, bn.keeps, bn.casts) == (BF16, BF16, FP32, ())
    assert (ln.computes, ln.out, ln.keeps, ln.casts) == (BF16, BF16, None, ())
    cuda_ln = norms["LayerNorm", "cuda"]
    assert (cuda_ln.computes, cuda_ln.out, cuda_ln.casts) == (FP32, FP32, ((BF16, FP32),))
    assert norms["BatchNorm1d", "cuda"].out == BF16
    table = norms.table()
    assert table.column("layer") == ["BatchNorm1d", "LayerNorm"] * 2
    assert table.column("running statistics") == [FP32, "none"] * 2
    assert "dtype=bfloat16" in repr(norms) and "<table" in norms._repr_html_()
    with pytest.raises(KeyError):
        norms["GroupNorm", "cpu"]


def test_norms_keep_the_warning_of_a_decomposed_rmsnorm():
    rms = training.norms(FP16, devices=("cpu",), layers=("RMSNorm",))["RMSNorm", "cpu"]
    assert rms.given == FP16 and (rms.computes, rms.out) == (FP32, FP16)
    assert rms.casts == ((FP16, FP32), (FP32, FP16))
    assert "Cannot dispatch to fused implementation" in rms.warning
    assert rms.row()[-1].endswith("Cannot dispatch to fused implementation")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float32"}, "autocast takes bfloat16 or float16"),
        ({"layers": ("InstanceNorm",)}, "unknown layer 'InstanceNorm'"),
        ({"features": 3}, "features must be an even number"),
        ({"devices": ("tpu",)}, "unknown device 'tpu'"),
    ],
)
def test_norms_reject_bad_input(kwargs, message):
    with pytest.raises(MPGuideError, match=message):
        training.norms(**kwargs)


def test_running_means_stop_short_in_low_precision():
    means = training.running_means(("float32", "bf16"), steps=60, mean=3.0, dev="cpu")
    assert means.buffers == (FP32, BF16)
    assert len(means.trace("float32")) == 60
    assert means.gap(FP32) < 1e-2 < means.gap(BF16)
    settled = means.settled_at(BF16)
    assert settled is not None and len(set(means.trace(BF16)[settled:])) == 1
    assert means.trace(BF16)[settled - 1] != means.trace(BF16)[settled]
    assert means.table().column("buffers") == [FP32, BF16]
    with pytest.raises(MPGuideError, match="no run with float16 buffers"):
        means.trace(FP16)


def test_running_means_settled_at_reads_the_trace():
    means = training.RunningMeans(
        3.0, 0.1, "cpu", ((FP32, (1.0, 2.0, 2.5)), (BF16, (1.0, 2.0, 2.0)))
    )
    assert means.settled_at(FP32) is None and means.settled_at(BF16) == 1
    assert means.gap(BF16) == 1.0
    assert means.table().column("stopped moving at step") == ["still moving", 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps must be at least 1"),
        ({"momentum": 0.0}, "momentum must be in"),
        ({"mean": float("inf")}, "mean must be finite"),
        ({"buffers": ("int8",)}, "unknown dtype 'int8'"),
    ],
)
def test_running_means_reject_bad_input(kwargs, message):
    with pytest.raises(MPGuideError, match=message):
        training.running_means(**kwargs)


def test_embedding_grads_lose_precision_in_a_bf16_table():
    sums = training.embedding_grads((1, 64, 1024), ("float32", "bfloat16"), dev="cpu")
    assert sums.ways == ("float32 table", "bfloat16 table") and sums.counts == (1, 64, 1024)
    f32, bf16 = sums.errors("float32 table"), sums.errors("bfloat16 table")
    assert f32[0] == bf16[0] == 0
    assert max(f32) < 1e-5 and bf16[2] > bf16[1] > 1e-3
    assert sums.table().column("uses of the row") == [1, 64, 1024]
    with pytest.raises(MPGuideError, match="unknown way 'fp8 table'"):
        sums.errors("fp8 table")


@pytest.mark.parametrize("counts", [(), (0, 1), (4, 2), (2, 2)])
def test_sweeps_reject_counts_that_do_not_increase(counts):
    with pytest.raises(MPGuideError, match="counts must be increasing positive integers"):
        training.embedding_grads(counts)
    with pytest.raises(MPGuideError, match="counts must be increasing positive integers"):
        training.grad_accumulation(counts)


def test_grad_accumulation_drifts_only_in_a_bf16_grad():
    sweep = training.grad_accumulation((1, 8, 32), dev="cpu")
    assert sweep.ways == training.GRAD_ACCUMULATION
    f32, bf16, kept = (sweep.errors(w) for w in training.GRAD_ACCUMULATION)
    assert max(f32) < 2**-20 and max(kept) < 2**-20
    assert bf16[0] == 0 and bf16[2] > 1e-3
    only = training.grad_accumulation((2,), ways=(training.GRAD_ACCUMULATION[1],), dev="cpu")
    assert only.ways == (training.GRAD_ACCUMULATION[1],) and len(only.stats[0]) == 1
    with pytest.raises(MPGuideError, match="unknown way 'float16 parameter'"):
        training.grad_accumulation(ways=("float16 parameter",))


def test_process_group_is_gone_after_the_block():
    import torch.distributed as dist

    with training.process_group():
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        with (
            pytest.raises(MPGuideError, match="already has a process group"),
            training.process_group(),
        ):
            pass
        assert dist.is_initialized()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "world_size": 2, "store": "x"}, "rank 2 is not in a world of 2"),
        ({"world_size": 0}, "rank 0 is not in a world of 0"),
        ({"world_size": 2}, "a world of 2 processes needs a store path"),
    ],
)
def test_process_group_rejects_bad_input(kwargs, message):
    with pytest.raises(MPGuideError, match=message), training.process_group(**kwargs):
        pass


def test_communication_in_two_processes():
    comm = training.communication(
        2, ("DDP, fp16_compress_hook", "FSDP2, param bf16, reduce bf16"), scales=(1.0, 1e-7)
    )
    assert comm.world_size == 2 and comm.scales == (1.0, 1e-7)
    ddp, fsdp = comm.get("DDP, fp16_compress_hook"), comm.get("FSDP2, param bf16, reduce bf16")
    assert [(str(c), c.nbytes) for c in ddp.collectives] == [
        ("allreduce_ f16", 2 * comm.parameters)
    ]
    assert ddp.grad_dtype == FP32 and ddp.comm_error.max_rel < 1e-2
    assert comm.get("DDP, fp16_compress_hook", 1e-7).flushed > 0.9
    assert fsdp.comm_dtypes == (BF16,) and fsdp.out_dtype == BF16 and fsdp.grad_dtype == FP32
    assert fsdp.comm_error.max_rel > 0 and fsdp.error.max_rel > fsdp.comm_error.max_rel
    assert all(r.ranks_agree for r in comm.runs)
    assert comm.table().column("setup") == [ddp.setup] * 2 + [fsdp.setup] * 2
    with pytest.raises(KeyError):
        comm.get("DDP")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be 1 to 8"),
        ({"setups": ("DDP", "Horovod")}, "unknown setup 'Horovod'"),
        ({"setups": ()}, "unknown setup None"),
        ({"scales": (1.0, -2.0)}, "scales must be positive finite numbers"),
        ({"timeout": 0}, "timeout must be positive"),
    ],
)
def test_communication_rejects_bad_input(kwargs, message):
    with pytest.raises(MPGuideError, match=message):
        training.communication(**kwargs)


def test_a_failing_rank_is_reported_in_one_line():
    with pytest.raises(RuntimeError, match=r"rank 0 failed: KeyError: 'no such setup'"):
        training._run_ranks(1, json.dumps([["no such setup", 1.0]]), timeout=120)


def test_ranks_past_the_timeout_are_killed():
    with pytest.raises(RuntimeError, match=r"the ranks did not finish in 0\.01 s"):
        training._run_ranks(1, json.dumps([["DDP", 1.0]]), timeout=0.01)
