import pytest
import torch

from mpguide import MPGuideError
from mpguide.autocast import policy
from mpguide.core import device

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16():
    return policy.probe(CPU, torch.bfloat16)


def test_catalogue_covers_the_families():
    names = {op.name for op in policy.CATALOGUE}
    assert len(policy.CATALOGUE) >= 60
    assert len(names) == len(policy.CATALOGUE)
    for name in (
        "matmul",
        "linear",
        "conv2d",
        "layer_norm",
        "rms_norm",
        "softmax",
        "log_softmax",
        "sum",
        "prod",
        "cumsum",
        "mean",
        "exp",
        "log",
        "pow (tensor, scalar)",
        "mse_loss",
        "cat",
        "stack",
        "addcmul",
    ):
        assert name in names


@pytest.mark.slow
def test_named_ops_fall_in_each_class_on_cpu(bf16):
    assert {"mm", "conv2d", "linear"} <= set(bf16.ops(policy.LOWER))
    assert {"prod", "mse_loss", "linalg_inv"} <= set(bf16.ops(policy.FLOAT32))
    assert bf16.ops(policy.PROMOTE) == ["cat", "index_copy", "stack"]
    assert {"exp", "softmax", "sum"} <= set(bf16.ops(policy.UNCHANGED))
    assert all(bf16[op].error for op in bf16.ops(policy.UNSUPPORTED))
    assert bf16.ops(policy.NEEDS_HARDWARE) == []


@pytest.mark.slow
def test_the_catalogue_is_every_registered_op(bf16):
    from mpguide.autocast import catalogue

    names = {p.op for p in bf16.probes}
    registered = catalogue.registered()
    assert set(catalogue.on("cpu")) <= set(registered) and "mm" in catalogue.on("cpu")
    assert names == {e.name for e in catalogue.entries() if e.op is not None}
    assert names <= set(registered)
    assert "cross" in registered and "linalg_cross" not in registered


@pytest.mark.slow
@pytest.mark.parametrize("op", ["matmul", "mm", "linear", "conv2d", "bmm"])
def test_matmul_family_runs_in_bf16_on_cpu(bf16, op):
    assert bf16.kind(op) == policy.LOWER
    assert bf16[op].fp32_in.out == torch.bfloat16
    assert "float32->bfloat16" in bf16[op].casts


@pytest.mark.slow
@pytest.mark.parametrize("op", ["mse_loss", "prod", "linalg_inv"])
def test_cpu_fp32_list_ops_upcast_bf16(bf16, op):
    assert bf16.kind(op) == policy.FLOAT32
    assert bf16[op].low_in.out == torch.float32


@pytest.mark.slow
def test_cat_promotes_on_cpu_but_addcmul_promotes_natively(bf16):
    # cat: autocast casts the bf16 input to float32 before the op.
    assert bf16.kind("cat") == policy.PROMOTE
    assert bf16["cat"].mixed_in.casts == ((torch.bfloat16, torch.float32),)
    # addcmul: no cast by autocast; the kernel's own type promotion gives float32.
    assert bf16.kind("addcmul") == policy.UNCHANGED
    assert bf16["addcmul"].mixed_in.casts == ()
    assert bf16["addcmul"].mixed_in.out == torch.float32


@pytest.mark.slow
def test_unchanged_ops_keep_their_input_dtype(bf16):
    for op in ("exp", "softmax", "sum"):
        assert bf16.kind(op) == policy.UNCHANGED
        assert bf16[op].fp32_in.out == torch.float32
        assert bf16[op].low_in.out == torch.bfloat16


def test_an_op_that_raises_is_reported_not_fatal():
    def boom(x):
        raise RuntimeError("no kernel\nsecond line")

    ops = [policy.Op("boom", "test", lambda t: (t(2),), boom), policy.CATALOGUE[0]]
    result = policy.probe(CPU, torch.bfloat16, ops=ops)
    assert result.kind("boom") == policy.UNSUPPORTED
    assert result["boom"].error == "RuntimeError: no kernel"
    assert result.kind("matmul") == policy.LOWER
    assert "RuntimeError: no kernel" in result.table().to_text()


@pytest.mark.slow
def test_a_mixed_only_error_keeps_the_uniform_class(bf16):
    probe = bf16["dot"]
    assert probe.mixed_in.error is not None and probe.kind != policy.UNSUPPORTED


def test_casts_of_an_ops_own_decomposition_are_not_autocasts():
    # rms_norm casts internally outside autocast too; none of that is autocast's.
    def upcasting(x):
        return x.float().exp().to(x.dtype)

    ops = [policy.Op("own", "test", lambda t: (t(4),), upcasting)]
    result = policy.probe(CPU, torch.bfloat16, ops=ops)
    assert result["own"].casts == ()
    assert result.kind("own") == policy.UNCHANGED


def test_warnings_are_captured_not_raised():
    import warnings

    def warns(x):
        warnings.warn("careful", UserWarning, stacklevel=1)
        return x

    result = policy.probe(
        CPU, torch.bfloat16, ops=[policy.Op("w", "test", lambda t: (t(2),), warns)]
    )
    assert result["w"].note == "UserWarning: careful"


@pytest.mark.slow
def test_table_is_grouped_by_class(bf16):
    kinds = bf16.table().column("class")
    order = [policy.CLASSES.index(k) for k in kinds]
    assert order == sorted(order)
    assert "torch " + torch.__version__ in bf16.caption


@pytest.mark.slow
def test_bf16_and_fp16_agree_on_cpu(bf16):
    fp16 = policy.probe(CPU, torch.float16)
    assert policy.differences(bf16, fp16).rows == ()
    assert policy.differences(bf16, bf16).rows == ()


@pytest.mark.slow
def test_differences_between_devices_name_both_labels(bf16, cuda_sim):
    diff = policy.differences(bf16, cuda_sim)
    assert diff.columns[2:4] == (f"cpu ({device.LIVE})", "cuda (simulated)")
    rows = {r[0]: r for r in diff.rows}
    assert rows["sum"][2:4] == (policy.UNCHANGED, policy.FLOAT32)
    assert rows["mv"][2:4] == (policy.UNCHANGED, policy.LOWER)
    assert "matmul" not in rows


def test_probe_rejects_a_dtype_autocast_does_not_take():
    with pytest.raises(MPGuideError, match="bfloat16 or float16"):
        policy.probe(CPU, torch.float32)


@pytest.mark.gpu
def test_cuda_runs_layer_norm_in_float32():
    result = policy.probe("cuda", torch.float16)
    assert result.kind("layer_norm") == policy.FLOAT32
    assert result.kind("matmul") == policy.LOWER


@pytest.fixture(scope="module")
def cuda_sim():
    return policy.probe("cuda", torch.bfloat16, simulate=True)


@pytest.mark.slow
def test_simulated_cuda_runs_reductions_softmax_and_norms_in_float32(cuda_sim):
    assert cuda_sim.how == device.SIMULATED and device.SIMULATED in cuda_sim.caption
    for op in ("sum", "cumsum", "softmax", "log_softmax", "logsumexp", "layer_norm", "exp"):
        assert cuda_sim.kind(op) == policy.FLOAT32, op
    for op in ("mv", "addmv", "addr", "matmul", "conv2d"):
        assert cuda_sim.kind(op) == policy.LOWER, op
    assert cuda_sim["mv"].undecided == ()  # autocast makes the mixed inputs bf16 first


@pytest.mark.slow
def test_simulated_cuda_adds_dtype_or_a_cast(cuda_sim):
    (sum_call,) = [c for c in cuda_sim["sum"].low_in.calls if c.op == "aten.sum.default"]
    assert sum_call.dtype_arg == torch.float32 and sum_call.out == torch.float32
    assert cuda_sim["softmax"].low_in.casts == ((torch.bfloat16, torch.float32),)


@pytest.mark.slow
def test_autocast_refusing_an_op_is_a_rule_not_a_gap(cuda_sim):
    bce = cuda_sim["binary_cross_entropy"]
    assert bce.kind == policy.UNSUPPORTED and bce.fp32_in.error and not bce.fp32_in.error_outside


@pytest.mark.slow
def test_a_kernel_that_refuses_the_dtype_on_the_cpu_too_is_unsupported(cuda_sim):
    quantile = cuda_sim["quantile"]
    assert quantile.kind == policy.UNSUPPORTED
    assert quantile.note.startswith("the kernel refuses the dtype")


@pytest.mark.slow
def test_a_meta_kernel_more_permissive_than_the_cpus_needs_hardware(cuda_sim):
    cholesky = cuda_sim["linalg_cholesky"]
    assert cholesky.kind == policy.NEEDS_HARDWARE and "the CPU kernel refuses" in cholesky.note


@pytest.mark.slow
def test_casts_before_a_raising_meta_kernel_decide_the_class(cuda_sim):
    # gru_cell has no meta kernel; CUDA autocast has cast its float32 inputs to bf16 by then
    assert cuda_sim.kind("gru_cell") == policy.LOWER
    assert cuda_sim["gru_cell"].note.startswith("from the casts autocast inserted")


@pytest.mark.slow
def test_simulation_reproduces_the_real_cpu_but_for_meta_gaps():
    gaps = policy.meta_gaps(torch.bfloat16, policy.CATALOGUE)
    assert list(gaps["pdist"]) == ["low_in"]
    assert "not implemented for 'BFloat16'" in gaps["pdist"]["low_in"]
    assert list(gaps["index_put"]) == ["mixed_in"]
    cpu = policy.probe(CPU, torch.bfloat16, ops=policy.CATALOGUE)
    simulated = policy.probe(CPU, torch.bfloat16, ops=policy.CATALOGUE, simulate=True)
    assert [r[0] for r in policy.differences(cpu, simulated).rows] == ["pdist"]
    assert simulated.kind("pdist") == policy.NEEDS_HARDWARE
    assert simulated["pdist"].note == gaps["pdist"]["low_in"]


@pytest.mark.slow
def test_a_mixed_run_the_meta_kernel_allows_is_marked_not_guessed(cuda_sim):
    # _addmm_activation: lower precision on CUDA from the float32 run; its mixed run reaches a
    # kernel that the CPU refuses for mixed dtypes, so that cell is undecided
    probe = cuda_sim["_addmm_activation"]
    assert probe.undecided == ("mixed_in",) and probe.note.startswith("mixed in: the CPU kernel")
    row = cuda_sim.table().where(op="_addmm_activation").records()[0]
    assert row["mixed in"] == policy.NEEDS_HARDWARE and row["class"] == probe.kind


def test_a_simulated_probe_restores_autocast_when_an_op_raises():
    def boom(x):
        raise RuntimeError("no kernel")

    before = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    ops = [policy.Op("boom", "test", lambda t: (t(2),), boom)]
    result = policy.probe("cuda", torch.bfloat16, ops=ops, simulate=True)
    assert result.kind("boom") == policy.NEEDS_HARDWARE
    assert (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) == before


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["table", "markdown", "json", "csv"])
def test_the_label_is_in_every_format(cuda_sim, bf16, fmt):
    assert device.SIMULATED in cuda_sim.table().render(fmt)
    assert device.LIVE in bf16.table().render(fmt)


def test_across_devices_marks_the_ops_that_differ():
    ops = [op for op in policy.CATALOGUE if op.name in ("matmul", "sum", "pdist")]
    both = policy.across(torch.bfloat16, ["cpu", "cuda"], ops, simulate=True)
    assert both.differences().column("op") == ["sum"]
    assert both.differing("cpu", "cuda") == ["sum"]
    assert both.table().notes == ("1 of 3 ops differ between devices: sum",)


@pytest.mark.gpu
def test_simulated_cuda_matches_the_gpu_where_it_decides():
    real = policy.probe("cuda", torch.bfloat16)
    simulated = policy.probe("cuda", torch.bfloat16, simulate=True)
    mismatches = policy.differences(real, simulated)
    print(mismatches)
    assert all(r[3] == policy.NEEDS_HARDWARE for r in mismatches.rows), mismatches
