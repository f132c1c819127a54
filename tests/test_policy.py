import pytest
import torch

from mpguide import MPGuideError, policy

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


def test_every_op_gets_exactly_one_class(bf16):
    assert sum(bf16.counts().values()) == len(policy.CATALOGUE)
    assert set(bf16.counts()) == set(policy.CLASSES)


@pytest.mark.parametrize("op", ["matmul", "mm", "linear", "conv2d", "bmm"])
def test_matmul_family_runs_in_bf16_on_cpu(bf16, op):
    assert bf16.kind(op) == policy.LOWER
    assert bf16[op].fp32_in.out == torch.bfloat16
    assert "float32->bfloat16" in bf16[op].casts


@pytest.mark.parametrize("op", ["mse_loss", "prod", "linalg.inv"])
def test_cpu_fp32_list_ops_upcast_bf16(bf16, op):
    assert bf16.kind(op) == policy.FLOAT32
    assert bf16[op].low_in.out == torch.float32


def test_cat_promotes_on_cpu_but_addcmul_promotes_natively(bf16):
    # cat: autocast casts the bf16 input to float32 before the op.
    assert bf16.kind("cat") == policy.PROMOTE
    assert bf16["cat"].mixed_in.casts == ((torch.bfloat16, torch.float32),)
    # addcmul: no cast by autocast; the kernel's own type promotion gives float32.
    assert bf16.kind("addcmul") == policy.UNCHANGED
    assert bf16["addcmul"].mixed_in.casts == ()
    assert bf16["addcmul"].mixed_in.out == torch.float32


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


def test_table_is_grouped_by_class(bf16):
    kinds = bf16.table().column("class")
    order = [policy.CLASSES.index(k) for k in kinds]
    assert order == sorted(order)
    assert "torch " + torch.__version__ in bf16.caption


def test_differences_lists_only_changed_ops(bf16):
    fp16 = policy.probe(CPU, torch.float16)
    diff = policy.differences(bf16, fp16)
    changed = [p.op for p in bf16.probes if p.kind != fp16.kind(p.op)]
    assert [r[0] for r in diff.rows] == changed
    same = policy.differences(bf16, bf16)
    assert same.rows == ()


def test_probe_rejects_a_dtype_autocast_does_not_take():
    with pytest.raises(MPGuideError, match="bfloat16 or float16"):
        policy.probe(CPU, torch.float32)


@pytest.mark.gpu
def test_cuda_runs_layer_norm_in_float32():
    result = policy.probe("cuda", torch.float16)
    assert result.kind("layer_norm") == policy.FLOAT32
    assert result.kind("matmul") == policy.LOWER
