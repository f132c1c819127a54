"""
Optimizer steps and float32 master weights
==========================================

Why keep a float32 copy of bf16 weights? Adding an update to a bf16 weight rounds the sum to
bf16, and an update smaller than half the spacing between bf16 numbers near the weight is lost
altogether. We show such an update, then train a tiny regression for a few hundred steps with
float32 weights, pure bf16 weights, and bf16 weights updated through a float32 master copy, on
this build's device, and plot the loss curves: pure bf16 stops learning, the master copy keeps
going.
"""

# %%
# Setup
# -----
# Everything runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present, else
# the CPU.
import torch

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.training import autograd, master_weights

dev = device.pick()
device.describe(dev)
BF16 = torch.bfloat16

# %%
# An update a bf16 weight cannot hold
# -----------------------------------
# Near 1.0, consecutive bf16 numbers are ``2**-7`` apart (float32's are ``2**-23``). Adding
# an update rounds to the nearest of them, so an update under half that spacing leaves the
# weight where it was.
w = torch.ones(1, device=dev, dtype=BF16)
gap = master_weights.spacing(w).item()
print(f"bf16 spacing above 1.0: {gap} (2**-7 = {2**-7}); half of it: {gap / 2}")
assert gap == 2**-7
assert master_weights.spacing(w.float()).item() == 2**-23

rows = []
for u in torch.tensor([[1e-3], [3e-3], [4.5e-3], [1e-2]], device=dev):
    lost = master_weights.lost(w, u).item()
    assert lost == (u.item() < gap / 2)
    assert not master_weights.lost(w.float(), u).item()
    rows.append(
        (
            f"{u.item():.4g}",
            u.item() < gap / 2,
            (w + u.to(BF16)).item(),
            f"{(w.float() + u).item():.7g}",
            lost,
        )
    )
Table(
    ("update", "under half the spacing", "1 + update in bf16", "1 + update in float32", "lost"),
    tuple(rows),
    f"adding an update to a weight of 1.0, torch {torch.__version__} on {dev.type}",
)

# %%
# The optimizer does the same. A bf16 parameter with gradient 0.1 and an SGD step of
# learning rate 0.01 should move by 0.001; it does not move at all.
param = torch.nn.Parameter(torch.ones(4, device=dev, dtype=BF16))
param.grad = torch.full_like(param, 0.1)
before = param.detach().clone()
torch.optim.SGD([param], lr=0.01).step()
print(f"bf16 parameter after the step: {param.detach().tolist()}")
assert torch.equal(param.detach(), before)

# %%
# Training with and without master weights
# ----------------------------------------
# :func:`mpguide.training.master_weights.train` fits ``y = X w*`` (256 samples, 16 weights that start
# at 1) by SGD for 300 steps, three ways: float32 weights; bf16 weights updated in place; bf16
# weights used in forward and backward while each update goes to a float32 master copy that
# is cast back into them. It records the loss and the share of updates the held weights
# lost at each step.
curves = {
    weights: master_weights.train(weights, steps=300, dev=dev) for weights in master_weights.WEIGHTS
}
for c in curves.values():
    print(c)

fp32, bf16, master = curves["float32"], curves["bfloat16"], curves["master"]
stalled_at = next(i for i, share in enumerate(bf16.lost_share) if share == 1.0)
print(f"pure bf16: every update lost from step {stalled_at} on")
assert stalled_at < 50
assert all(share == 1.0 for share in bf16.lost_share[stalled_at:])
assert len(set(bf16.losses[stalled_at + 1 :])) == 1
assert master.final < bf16.final / 10
assert fp32.final < master.final
mean_lost = {name: sum(c.lost_share) / len(c.lost_share) for name, c in curves.items()}
print(", ".join(f"{name}: {share:.2%} of updates lost" for name, share in mean_lost.items()))
assert mean_lost["bfloat16"] > 0.9 and mean_lost["master"] < 0.01
fp32_first_lost = next((i for i, share in enumerate(fp32.lost_share) if share), None)
assert fp32_first_lost is None or fp32.losses[fp32_first_lost] < master.final

# %%
# The loss curves
# ---------------
from mpguide import plots

labels = {
    "float32": "float32 weights",
    "bfloat16": "bf16 weights",
    "master": "bf16 weights, float32 master",
}
_ = plots.training_curves(
    {labels[name]: c for name, c in curves.items()},
    title=f"SGD on a tiny regression, torch {torch.__version__} on {dev.type}",
)

# %%
# Pure bf16 stops within a few dozen steps, at the loss printed above: once the updates
# shrink below half the spacing around each weight, every one is rounded away. With the
# master copy, small updates accumulate in float32 until they move the bf16 weight, and the
# loss keeps falling to the level bf16 weights can express; float32 weights go further, and
# lose updates of their own (if any) only once their loss is below the master copy's final
# one.
#
# The cost of the master copy
# ---------------------------
# Besides 4 bytes per parameter for the copy, every step casts the updated copy into the bf16
# weights. :class:`~mpguide.training.autograd.DtypeLog` sees that ``copy_`` as a cast.
weight = torch.ones(16, 1, device=dev, dtype=BF16)
master_copy = weight.float()
update = torch.full_like(master_copy, -1e-3)
with autograd.DtypeLog() as log, log.phase("optimizer"):
    master_copy.add_(update)
    weight.copy_(master_copy)
casts = log.select("optimizer", casts=True)
assert [(r.op, r.cast) for r in casts] == [("aten.copy_.default", "float32->bfloat16")]
assert casts[0].cast_bytes == weight.numel() * 6
log.casts()

# %%
# What we saw
# -----------
# - Near 1.0, bf16 numbers are ``2**-7`` apart; an update under half of that is lost when
#   added to a bf16 weight, by hand or by ``torch.optim.SGD``, and kept in float32.
# - Trained with pure bf16 weights, the regression stops improving once all its updates are
#   lost; with a float32 master copy it reaches a loss more than ten times lower; float32
#   weights reach lower still.
# - The master copy costs a float32 tensor per parameter and a float32 -> bf16 cast of it
#   every step.
#
# .. admonition:: References
#
#    :torchapi:`torch.optim.SGD`, :torchapi:`torch.nextafter`, :torchapi:`torch.Tensor.copy_`,
#    :torchdoc:`amp.html`
