import pytest
import torch

from mpguide import MPGuideError
from mpguide.core import device


def test_pick_is_cuda_exactly_when_available(monkeypatch):
    monkeypatch.delenv("MPGUIDE_DEVICE", raising=False)
    assert device.pick().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_pick_honours_the_override(monkeypatch):
    monkeypatch.setenv("MPGUIDE_DEVICE", "cpu")
    assert device.pick() == torch.device("cpu")


def test_override_to_a_missing_device_fails(monkeypatch):
    monkeypatch.setenv("MPGUIDE_DEVICE", "tpu")
    with pytest.raises(MPGuideError, match="unknown device 'tpu'"):
        device.pick()


@pytest.mark.parametrize("name", ["tpu", "gpu", "cpu:x"])
def test_resolve_rejects_unknown_devices(name):
    with pytest.raises(MPGuideError, match="unknown device"):
        device.resolve(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_resolve_rejects_cuda_without_a_gpu():
    with pytest.raises(MPGuideError, match="not available"):
        device.resolve("cuda")


@pytest.mark.gpu
def test_resolve_rejects_a_cuda_index_past_the_last():
    with pytest.raises(MPGuideError, match="CUDA device"):
        device.resolve(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.gpu
def test_a_gpu_machine_still_simulates_the_device_types_it_lacks():
    # torch sets up a GPU context for every new fake cuda or xpu tensor when CUDA is present
    kernels = device.autocast_kernels()
    assert "xpu" not in kernels or "xpu" in device.simulated_types()


@pytest.mark.gpu
def test_tensors_moves_the_modules_to_a_live_device_for_the_block():
    lin = torch.nn.Linear(4, 4)
    with device.tensors(device.target("cuda"), [lin]):
        assert lin.weight.device.type == "cuda" and isinstance(lin.weight, torch.nn.Parameter)
        assert lin(torch.randn(2, 4, device="cuda")).device.type == "cuda"
    assert lin.weight.device.type == "cpu"


def test_describe_names_torch_and_the_device():
    m = device.describe("cpu")
    assert m.device == "cpu"
    assert m.torch == torch.__version__
    assert torch.__version__ in m.caption() and "cpu" in m.caption()
    assert m.caption() in m._repr_html_()


@pytest.mark.gpu
def test_describe_cuda_names_the_gpu():
    m = device.describe("cuda")
    assert m.name == torch.cuda.get_device_name(0)


def test_autocast_devices_are_read_from_the_dispatcher():
    kernels = device.autocast_kernels()
    assert list(kernels)[:2] == ["cpu", "cuda"]
    assert kernels["cpu"] > 50 and kernels["cuda"] > 50
    simulated = device.simulated_types()
    assert {"cpu", "cuda"} <= set(simulated) <= set(kernels)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_missing_device_is_simulated_and_a_present_one_is_live():
    cuda = device.target("cuda")
    assert cuda.simulated and cuda.how == device.SIMULATED
    assert cuda.describe().name == "simulated" and device.SIMULATED in cuda.describe().detail
    assert device.target("cpu").how == device.LIVE
    assert device.target("cpu", simulate=True).simulated


@pytest.mark.parametrize("name", ["tpu", "gpu", "ipu"])
def test_target_refuses_a_device_type_the_build_cannot_simulate(name):
    with pytest.raises(MPGuideError, match=rf"unknown device '{name}'; this build's autocast"):
        device.target(name)


def test_simulate_gives_cuda_rules_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensor

    with device.simulate("cuda", "bf16") as dev:
        x = torch.randn(4, 16, device=dev)
        assert isinstance(x, FakeTensor) and x.device.type == "cuda"
        assert torch.softmax(x.to(torch.bfloat16), -1).dtype == torch.float32
        assert torch.mm(x, x.T).dtype == torch.bfloat16
    assert not isinstance(torch.randn(2), FakeTensor)


def test_simulate_restores_every_switch_even_when_the_block_raises():
    before = (
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_cache_enabled(),
    )
    with pytest.raises(RuntimeError, match="boom"), device.simulate("cuda", torch.bfloat16):
        assert torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16
        raise RuntimeError("boom")
    after = (
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_cache_enabled(),
    )
    assert after == before
    assert type(torch.randn(2)) is torch.Tensor


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_module_with_parameters_on_a_simulated_cuda_does_not_abort():
    # Autograd on fake CUDA tensors aborts a CPU-only build's process: run it in another one.
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from mpguide.core import device\n"
        "with device.simulate('cuda', torch.bfloat16) as dev:\n"
        "    norm = torch.nn.LayerNorm(8, device=dev)\n"
        "    print(norm(torch.randn(2, 8, device=dev).bfloat16()).dtype)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-500:]
    assert proc.stdout == "torch.float32\n"


# -- real modules on a simulated device ------------------------------------------------------

_INDICES = [
    0,
    -1,
    slice(1, 3),
    (Ellipsis, None),
    (None, Ellipsis, 1),
    (1, slice(None), None),
    (slice(None, None, 2), Ellipsis, slice(1, None)),
    torch.tensor([0, 2]),
    [2, 0],
    (slice(None), torch.tensor([1, 0])),
    (torch.tensor([0, 1]), slice(None), torch.tensor([1, 1])),
    (Ellipsis, torch.tensor([3, 0])),
    (None, 1, torch.tensor([[0], [2]])),
    torch.tensor(1),
    True,
]


@pytest.mark.parametrize("index", _INDICES, ids=repr)
def test_indexing_in_aten_ops_equals_the_binding(index):
    methods = device._aten_methods(indexing=True)
    x = torch.arange(3 * 4 * 5.0).reshape(3, 4, 5)
    assert torch.equal(methods["__getitem__"](x, index), x[index])
    mine, theirs = x.clone(), x.clone()
    methods["__setitem__"](mine, index, -1.0)
    theirs[index] = -1.0
    assert torch.equal(mine, theirs)
    value = -torch.ones_like(x[index])
    methods["__setitem__"](mine, index, value * 2)
    theirs[index] = value * 2
    assert torch.equal(mine, theirs)
    t = x.transpose(0, 2)
    assert torch.equal(methods["contiguous"](t), t.contiguous())
    assert methods["contiguous"](x) is x


def test_a_real_module_follows_a_simulated_device_and_comes_back():
    from torch._subclasses.fake_tensor import FakeTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    model.append(torch.nn.Linear(8, 8)).eval()
    model[2].weight = model[0].weight  # tied
    before = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    methods = dict(vars(torch.Tensor))
    cuda = device.target("cuda", simulate=True)
    with device.tensors(cuda, [model, model[0]]):
        inside = dict(model.named_parameters(remove_duplicate=False))
        assert all(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in inside.values())
        assert isinstance(model[1].running_mean, FakeTensor)
        assert isinstance(inside["0.weight"], torch.nn.Parameter)
        assert inside["0.weight"] is inside["2.weight"] and inside["0.bias"].requires_grad
        x = device.move(torch.ones(4, 8), cuda)
        out = model(x)[..., None].contiguous()
        assert (out.device.type, out.shape) == ("cuda", (4, 8, 1))
    after = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert model[2].weight is model[0].weight
    assert dict(vars(torch.Tensor)) == methods


def test_move_copies_to_a_live_device_and_fakes_a_simulated_one():
    from torch._subclasses.fake_tensor import FakeTensor

    x = {"ids": torch.zeros(2, 3, dtype=torch.long), "flag": True}
    assert device.move(x, device.target("cpu"))["ids"] is x["ids"]
    cuda = device.target("cuda", simulate=True)
    with device.tensors(cuda):
        moved = device.move(x, cuda)
        assert isinstance(moved["ids"], FakeTensor) and moved["ids"].device.type == "cuda"
        assert moved["ids"].dtype == torch.int64 and moved["flag"] is True


def test_accepts_names_what_cpu_autocast_takes():
    assert device.accepts("cpu", torch.bfloat16) == (True, "")
    enabled, said = device.accepts("cpu", torch.float64)
    assert not enabled and "target dtype is not supported" in said
    assert not torch.is_autocast_enabled("cpu")
