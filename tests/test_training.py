"""Tests of the training loop's modules: mpguide.training.loss_scaling, optimizers, loop,
norm_layers, grad_sums and distributed."""

import json
import math

import pytest
import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.core import device
from mpguide.training import (
    distributed,
    grad_sums,
    loop,
    loss_scaling,
    norm_layers,
    optimizers,
)

BF16, FP16 = torch.bfloat16, torch.float16

# --- Loss scaling, optimizer precision, whole training loops ---


def test_landing_sorts_values_by_where_they_land():
    values = torch.tensor([2.0**-30, 2.0**-20, 1.0, 1e5, 0.0, -(2.0**-20)])
    plain = loss_scaling.landing(values, "fp16")
    assert (plain.values, plain.flushed, plain.subnormal, plain.normal, plain.overflow) == (
        5,
        1,
        2,
        1,
        1,
    )
    assert plain.share("subnormal") == 2 / 5
    scaled = loss_scaling.landing(values, FP16, 2.0**16)
    assert (scaled.flushed, scaled.subnormal, scaled.normal, scaled.overflow) == (0, 0, 3, 2)
    bf16 = loss_scaling.landing(values, BF16, 2.0**16)
    assert bf16.normal == bf16.values == 5
    table = loss_scaling.landing_table([plain, scaled])
    assert table.column("scale") == ["2**0", "2**16"]
    assert table.column("flushed") == ["20.00%", "0.00%"]
    assert "5 values x 1 in float16: 20.00% flushed" in repr(plain)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.arange(3), "fp16"), "floating values"),
        ((torch.ones(3), "fp16", 0.0), "positive finite"),
        ((torch.ones(3), "fp16", math.inf), "positive finite"),
        ((torch.ones(3), "int8"), "unknown dtype"),
    ],
)
def test_landing_refuses_bad_input(args, message):
    with pytest.raises(MPGuideError, match=message):
        loss_scaling.landing(*args)
    with pytest.raises(MPGuideError, match="unknown outcome"):
        loss_scaling.landing(torch.ones(2), "bf16").share("lost")


def _confident_classifier():
    """A Linear whose class 0 wins by a margin of 20: the other classes' gradients are ~1e-10."""
    model = nn.Sequential(nn.Linear(4, 50))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
        model[0].bias[0] = 20.0
    return (
        model,
        torch.randn(8, 4, generator=torch.Generator().manual_seed(0)),
        torch.zeros(8, dtype=torch.long),
    )


def test_gradients_read_parameters_and_activations_and_fp16_flushes_them():
    model, x, y = _confident_classifier()
    ref = loss_scaling.gradients(model, x, y)
    loss = nn.functional.cross_entropy(model(x), y)
    expected = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])
    assert torch.equal(ref.parameters, expected)
    assert ref.activations.shape == (8 * 50,) and ref.activation_dtype == torch.float32
    assert 0 < ref.activations[ref.activations != 0].abs().max() < 2**-24 * 2
    assert all(p.grad is None for p in model.parameters())
    assert not model[0]._forward_hooks

    fp16 = loss_scaling.gradients(model, x, y, "fp16")
    assert fp16.activation_dtype == FP16
    params_lost, acts_lost = fp16.flushed(ref)
    assert acts_lost > 0.5 and params_lost > 0
    scaled = loss_scaling.gradients(model, x, y, "fp16", 2.0**16)
    assert scaled.flushed(ref)[1] == 0.0 and scaled.scale == 2.0**16
    assert loss_scaling.gradients(model, x, y, "bf16").flushed(ref)[1] == 0.0
    assert repr(scaled).startswith("autocast f16, loss x 65536: 250 parameter gradients")


def test_gradients_refuse_bad_input():
    model, x, y = _confident_classifier()
    with pytest.raises(MPGuideError, match="positive finite"):
        loss_scaling.gradients(model, x, y, scale=-1.0)
    with pytest.raises(MPGuideError, match="autocast takes"):
        loss_scaling.gradients(model, x, y, "float32")
    with pytest.raises(MPGuideError, match=r"no nn\.Linear"):
        loss_scaling.gradients(nn.Sequential(nn.Identity()), x, y)
    other = loss_scaling.gradients(nn.Sequential(nn.Linear(4, 3)), x, y)
    with pytest.raises(MPGuideError, match="another model"):
        loss_scaling.gradients(model, x, y).flushed(other)


def test_scale_schedule_follows_the_rule_and_torch_gradscaler():
    pattern = [True, True, False, False, False, True, False, False, False]
    scales = loss_scaling.scale_schedule(pattern, init_scale=8.0, growth_interval=2)
    assert scales == (8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 2.0, 2.0, 4.0)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    seen = []
    for inf in pattern:
        scaler.scale(p.sum()).backward()
        if inf:
            p.grad[0] = math.inf
        seen.append(scaler.get_scale())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert tuple(seen) == scales


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0.0}, "init_scale > 0"),
        ({"growth_factor": 1.0}, "growth_factor > 1"),
        ({"backoff_factor": 1.0}, "backoff_factor < 1"),
        ({"growth_interval": 0}, "growth_interval must be"),
    ],
)
def test_scale_schedule_refuses_bad_settings(kwargs, message):
    with pytest.raises(MPGuideError, match=message):
        loss_scaling.scale_schedule([False], **kwargs)


def test_stochastic_round_picks_a_neighbour_with_the_right_odds():
    exact = torch.tensor([1.0, -2.5, 0.0, 3.0e38]).to(BF16).float()
    assert torch.equal(optimizers.stochastic_round(exact).float(), exact)
    special = torch.tensor([math.inf, -math.inf, math.nan])
    out = optimizers.stochastic_round(special).float()
    assert out[0] == math.inf and out[1] == -math.inf and out[2].isnan()

    gen = torch.Generator().manual_seed(0)
    for sign in (1.0, -1.0):
        x = torch.full((40000,), sign * (1 + 2**-9))  # a quarter of the way to the next bf16
        r = optimizers.stochastic_round(x, gen)
        assert r.dtype == BF16
        assert set(r.float().unique().tolist()) == {sign * 1.0, sign * (1 + 2**-7)}
        up = ((r.float() - sign).abs() > 0).float().mean().item()
        assert abs(up - 0.25) < 4 * math.sqrt(0.25 * 0.75 / x.numel())
        assert abs(r.float().mean().item() - sign * (1 + 2**-9)) < 1e-4
    same = [optimizers.stochastic_round(x, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*same)
    with pytest.raises(MPGuideError, match="needs a float32 tensor"):
        optimizers.stochastic_round(x.double())


def test_kahan_add_keeps_what_rounding_dropped():
    exact = 1 + 1000 * 1e-4
    for comp_dtype, tolerance in ((torch.float32, 1e-5), (BF16, 5e-3)):
        w, comp = torch.ones(3, dtype=BF16), torch.zeros(3, dtype=comp_dtype)
        for _ in range(1000):
            optimizers.kahan_add_(w, comp, torch.full((3,), 1e-4))
        # A bf16 compensation rounds too: it keeps most, not all, of what the weight dropped.
        assert ((w.float() + comp.float()) - exact).abs().max() < tolerance
        assert (w.float() - exact).abs().max() <= 2**-7
    with pytest.raises(MPGuideError, match="compensation has shape"):
        optimizers.kahan_add_(w, torch.zeros(2, dtype=BF16), torch.ones(3))


def test_rounded_add_and_accumulate():
    w = torch.ones(4, dtype=BF16)
    optimizers.rounded_add_(w, torch.full((4,), 3e-3))
    assert torch.equal(w, torch.full((4,), 1 + 3e-3).to(BF16))
    with pytest.raises(MPGuideError, match="unknown rounding"):
        optimizers.rounded_add_(w, torch.ones(4), "down")
    with pytest.raises(MPGuideError, match="needs a compensation"):
        optimizers.rounded_add_(w, torch.ones(4), "kahan")
    with pytest.raises(MPGuideError, match="writes bfloat16 weights"):
        optimizers.rounded_add_(torch.ones(4, dtype=FP16), torch.ones(4), "stochastic")

    start = torch.ones(64, dtype=BF16)
    nearest = optimizers.accumulate(start, 1e-4, 50)
    assert nearest.shape == (51, 64) and nearest.dtype == torch.float32
    assert (nearest == 1.0).all()
    f32 = optimizers.accumulate(start.float(), 1e-4, 50)
    assert abs(f32[-1, 0].item() - 1.005) < 1e-6
    sr = optimizers.accumulate(start, 1e-4, 50, "stochastic", torch.Generator().manual_seed(0))
    assert (sr[-1] > 1.0).any() and torch.equal(sr[0], start.float())
    with pytest.raises(MPGuideError, match="steps must be"):
        optimizers.accumulate(start, 1e-4, 0)


def _two_params(dtype):
    gen = torch.Generator().manual_seed(0)
    return [
        nn.Parameter(torch.randn(8, 4, generator=gen).to(dtype)),
        nn.Parameter(torch.randn(4, generator=gen).to(dtype)),
    ]


def _step_both(opts, params_sets, steps=5):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen) for p in params_sets[0]]
        for opt, params in zip(opts, params_sets, strict=True):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(p.dtype)
            opt.step()


def test_rounded_adamw_is_torch_adamw_on_float32_weights():
    ours, theirs = _two_params(torch.float32), _two_params(torch.float32)
    opts = [
        optimizers.RoundedAdamW(ours, lr=1e-2, weight_decay=0.1),
        torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False),
    ]
    _step_both(opts, [ours, theirs])
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opts[0].state[a][key], opts[1].state[b][key])


@pytest.mark.parametrize("rounding", optimizers.ROUNDINGS)
def test_rounded_adamw_keeps_bf16_weights_and_states(rounding):
    gen = torch.Generator().manual_seed(2)
    ours, ref = _two_params(BF16), _two_params(torch.float32)
    opts = [
        optimizers.RoundedAdamW(ours, lr=1e-3, rounding=rounding, generator=gen),
        torch.optim.AdamW(ref, lr=1e-3),
    ]
    _step_both(opts, [ours, ref], steps=3)
    for p, r in zip(ours, ref, strict=True):
        state = opts[0].state[p]
        assert p.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == BF16
        assert ("compensation" in state) == (rounding == "kahan")
        held = p.float() + (state["compensation"].float() if rounding == "kahan" else 0)
        assert (held - r).abs().max() < 2**-6 * r.abs().max()


def test_rounded_adamw_refuses_bad_input():
    with pytest.raises(MPGuideError, match="unknown rounding"):
        optimizers.RoundedAdamW(_two_params(BF16), rounding="up")
    with pytest.raises(MPGuideError, match="writes bfloat16 weights, not float32"):
        optimizers.RoundedAdamW(_two_params(torch.float32), rounding="stochastic")
    with pytest.raises(MPGuideError, match="no closure"):
        optimizers.RoundedAdamW(_two_params(BF16)).step(lambda: 0.0)


def test_optimizer_states_follow_the_weights_on_cpu_and_simulated_cuda():
    states = optimizers.optimizer_states(
        ("AdamW", "SGD(momentum=0.9, fused=True)"), ("fp32", "bf16"), ("cpu", "cuda")
    )
    cpu = states.get("AdamW", "bf16", "cpu")
    assert cpu.how == device.LIVE and cpu.dtype("exp_avg") == cpu.dtype("exp_avg_sq") == BF16
    assert cpu.dtype("step") == torch.float32
    assert (
        states.get("SGD(momentum=0.9, fused=True)", "bf16", "cpu").dtype("momentum_buffer") == BF16
    )
    table = states.table()
    assert table.columns[1:3] == (
        "f32 weights, cpu (ran on hardware)",
        "bf16 weights, cpu (ran on hardware)",
    )
    assert table.column("state") == [
        "AdamW: step",
        "AdamW: exp_avg",
        "AdamW: exp_avg_sq",
        "SGD(momentum=0.9, fused=True): momentum_buffer",
    ]
    if not torch.cuda.is_available():
        cuda = states.get("AdamW", "fp32", "cuda")
        assert cuda.how == device.SIMULATED and cuda.dtype("exp_avg") == torch.float32
        sgd = states.get("SGD(momentum=0.9, fused=True)", "fp32", "cuda")
        assert sgd.error and sgd.cell("momentum_buffer") == device.NEEDS_HARDWARE
        with pytest.raises(MPGuideError, match="keeps no state"):
            sgd.dtype("momentum_buffer")
        assert table.column("f32 weights, cuda (simulated)")[-1] == device.NEEDS_HARDWARE
    assert "AdamW: exp_avg_sq" in repr(states) and "<table" in states._repr_html_()
    with pytest.raises(MPGuideError, match="no result for AdamW with float16"):
        states.get("AdamW", "fp16", "cpu")
    with pytest.raises(MPGuideError, match="unknown optimizer 'Lion'"):
        optimizers.optimizer_states(("Lion",))


def test_char_task_batches_and_model():
    task = loop.char_task(context=4)
    assert task.source == "torch/optim/optimizer.py" and len(task.vocab) > 40
    x, y = task.batch(16, torch.Generator().manual_seed(0))
    assert x.shape == (16, 4) and y.shape == (16,)
    assert int(x.max()) < len(task.vocab)
    # The windows are consecutive codes of the text.
    split = len(task.codes) * 9 // 10
    hx, hy = task.batch(16, torch.Generator().manual_seed(0), held_out=True)
    text = "".join(task.vocab[i] for i in task.codes.tolist())
    window = "".join(task.vocab[i] for i in [*hx[0].tolist(), hy[0].item()])
    assert text.find(window, split) >= split
    state = torch.random.get_rng_state()
    a, b = task.model(seed=3), task.model(seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert a(x).shape == (16, len(task.vocab))
    assert repr(task).startswith("next character of torch/optim/optimizer.py")
    with pytest.raises(MPGuideError, match="context must be"):
        loop.char_task(0)
    with pytest.raises(MPGuideError, match="at least one sample"):
        task.batch(0, torch.Generator())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"update": "sgd"}, "unknown update"),
        ({"update": "master"}, "for low-precision weights"),
        ({"weights": FP16, "update": "stochastic"}, "stochastic rounding writes bfloat16"),
        ({"init_scale": -1.0}, "init_scale must be"),
        ({"weights": FP16, "init_scale": 2.0**16}, "cannot unscale"),
        ({"growth_interval": 0}, "growth_interval must be"),
    ],
)
def test_recipe_refuses_bad_settings(kwargs, message):
    with pytest.raises(MPGuideError, match=message):
        loop.Recipe("x", **kwargs)


def test_recipe_lookup_and_setup():
    assert loop.recipe("bf16") is loop.RECIPES["bf16"]
    assert loop.recipe(loop.RECIPES["fp32"]) is loop.RECIPES["fp32"]
    assert loop.RECIPES["autocast-fp16"].setup == (
        "f32 weights, autocast f16, AdamW, GradScaler from 2**16"
    )
    with pytest.raises(MPGuideError, match="unknown recipe 'fp8'"):
        loop.recipe("fp8")


@pytest.fixture(scope="module")
def runs():
    overflowing = loop.Recipe(
        "fp16 from 2**24", autocast=FP16, init_scale=2.0**24, growth_interval=2
    )
    return loop.train(
        ["fp32", "bf16", "bf16-master", "bf16-kahan", overflowing],
        loop.char_task(),
        steps=6,
        batch=8,
        eval_every=3,
        dev="cpu",
    )


def test_train_runs_recipes_in_lockstep(runs):
    fp32, bf16, master, kahan, fp16 = runs.runs
    assert [s for s, _ in fp32.evals] == [0, 3, 6]
    assert fp32.evals[0][1] == fp16.evals[0][1]  # same initial weights
    assert abs(bf16.evals[0][1] - fp32.evals[0][1]) < 1e-2
    assert len(fp32.losses) == len(fp32.latency.times) == 6 and fp32.scales == ()
    assert fp16.scales == loss_scaling.scale_schedule(fp16.found_inf, 2.0**24, 2)
    assert fp16.skipped == tuple(i for i, inf in enumerate(fp16.found_inf) if inf)
    assert fp16.found_inf[0] and fp16.skipped[0] == 0
    assert (
        dict(fp32.state_dtypes)["exp_avg"] == dict(master.state_dtypes)["exp_avg"] == torch.float32
    )
    assert dict(bf16.state_dtypes)["exp_avg_sq"] == dict(kahan.state_dtypes)["compensation"] == BF16
    assert (fp32.bytes_per_parameter, bf16.bytes_per_parameter) == (12, 6)
    assert (master.bytes_per_parameter, kahan.bytes_per_parameter) == (14, 8)
    assert all(p.dtype == BF16 for p in bf16.model.parameters())
    assert max(fp32.weights_unchanged) < 0.5


def test_runs_table_and_lookup(runs):
    assert runs["bf16"] is runs.runs[1] and runs["fp16 from 2**24"] is runs.runs[4]
    table = runs.table()
    assert table.column("recipe")[0] == "fp32" and table.column("vs fp32")[0] == "+0.0000"
    assert table.column("time vs fp32")[0] == "1.00"
    assert table.column("skipped steps")[-1] == len(runs.runs[4].skipped) > 0
    assert "6 steps each" in table.caption and "pure bf16: 6 steps" in repr(runs.runs[1])
    assert "<table" in runs._repr_html_()
    with pytest.raises(MPGuideError, match="no run of 'bf16-stochastic'"):
        runs["bf16-stochastic"]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ([], {}, "no recipe"),
        (["fp32"], {"steps": 0}, "at least 1"),
        (["fp32"], {"lr": -1.0}, "learning rate"),
        (["fp64"], {}, "unknown recipe"),
        (["fp32"], {"dev": "tpu"}, "unknown device"),
    ],
)
def test_train_refuses_bad_input(args, kwargs, message):
    with pytest.raises(MPGuideError, match=message):
        loop.train(args, steps=kwargs.pop("steps", 1), **kwargs)


# --- Layers with state, recompute, communication dtypes ---


FP32 = torch.float32


def test_norms_follow_each_devices_autocast():
    norms = norm_layers.norms("bf16", devices=("cpu", "cuda"), layers=("BatchNorm1d", "LayerNorm"))
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
    rms = norm_layers.norms(FP16, devices=("cpu",), layers=("RMSNorm",))["RMSNorm", "cpu"]
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
        norm_layers.norms(**kwargs)


def test_running_means_stop_short_in_low_precision():
    means = norm_layers.running_means(("float32", "bf16"), steps=60, mean=3.0, dev="cpu")
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
    means = norm_layers.RunningMeans(
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
        norm_layers.running_means(**kwargs)


def test_embedding_grads_lose_precision_in_a_bf16_table():
    sums = grad_sums.embedding_grads((1, 64, 1024), ("float32", "bfloat16"), dev="cpu")
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
        grad_sums.embedding_grads(counts)
    with pytest.raises(MPGuideError, match="counts must be increasing positive integers"):
        grad_sums.grad_accumulation(counts)


def test_grad_accumulation_drifts_only_in_a_bf16_grad():
    sweep = grad_sums.grad_accumulation((1, 8, 32), dev="cpu")
    assert sweep.ways == grad_sums.GRAD_ACCUMULATION
    f32, bf16, kept = (sweep.errors(w) for w in grad_sums.GRAD_ACCUMULATION)
    assert max(f32) < 2**-20 and max(kept) < 2**-20
    assert bf16[0] == 0 and bf16[2] > 1e-3
    only = grad_sums.grad_accumulation((2,), ways=(grad_sums.GRAD_ACCUMULATION[1],), dev="cpu")
    assert only.ways == (grad_sums.GRAD_ACCUMULATION[1],) and len(only.stats[0]) == 1
    with pytest.raises(MPGuideError, match="unknown way 'float16 parameter'"):
        grad_sums.grad_accumulation(ways=("float16 parameter",))


def test_process_group_is_gone_after_the_block():
    import torch.distributed as dist

    with distributed.process_group():
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        with (
            pytest.raises(MPGuideError, match="already has a process group"),
            distributed.process_group(),
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
    with pytest.raises(MPGuideError, match=message), distributed.process_group(**kwargs):
        pass


def test_shard_wraps_each_block_then_the_root_with_the_policy():
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from mpguide.core import dtypes

    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    with pytest.raises(MPGuideError, match="shard needs a process group"):
        distributed.shard(nn.Linear(2, 2))
    with distributed.process_group():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        assert distributed.shard(model, policy) is model
        assert [isinstance(m, FSDPModule) for m in model] == [True, False, True]
        assert isinstance(model, FSDPModule) and isinstance(model[0].weight, DTensor)
        with dtypes.Log() as log:
            model(torch.randn(3, 4)).float().sum().backward()
        copies = distributed.reduce_scatter_inputs(log)
        assert len(copies) == 2  # one per group that holds parameters
        assert all(c.ins[:-1] == (BF16,) * (len(c.ins) - 1) and c.ins[-1] == FP32 for c in copies)
        whole = distributed.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), units=())
        assert not any(isinstance(m, FSDPModule) for m in whole)
        assert isinstance(whole, FSDPModule)


@pytest.mark.slow
def test_communication_in_two_processes():
    comm = distributed.communication(
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
        distributed.communication(**kwargs)


@pytest.mark.slow
def test_a_failing_rank_is_reported_in_one_line():
    with pytest.raises(RuntimeError, match=r"rank 0 failed: KeyError: 'no such setup'"):
        distributed._run_ranks(1, json.dumps([["no such setup", 1.0]]), timeout=120)


def test_ranks_past_the_timeout_are_killed():
    with pytest.raises(RuntimeError, match=r"the ranks did not finish in 0\.01 s"):
        distributed._run_ranks(1, json.dumps([["DDP", 1.0]]), timeout=0.01)
