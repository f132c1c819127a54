"""
The autocast policy, probed op by op
====================================

Which ops does autocast run in low precision, which in float32, and which does it leave
alone? Instead of copying a list, :func:`mpguide.policy.probe` runs every op of a catalogue
under :func:`torch.autocast` with float32 inputs, with low-precision inputs and with mixed
inputs, records the casts autocast inserts, and classifies the op from what happened. We
probe bf16 and fp16 on this build's device and compare them.
"""

# %%
# Setup
# -----
import textwrap

import torch

from mpguide import device, policy

dev = device.pick()
device.describe(dev)

# %%
# Probing bf16
# ------------
# Each op runs three ways. The class comes from the outcome: ``lower precision`` when float32
# inputs come out in bf16, ``float32`` when bf16 inputs come out in float32, ``promote`` when
# autocast casts mixed inputs to the widest dtype, ``unchanged`` when it casts nothing,
# ``unsupported`` when the op raises on uniform inputs.
bf16 = policy.probe(dev, torch.bfloat16)
counts = bf16.counts()
print(f"{len(bf16.probes)} ops probed")
for kind, n in counts.items():
    print(f"  {kind:<16} {n:>3}")
assert len(bf16.probes) >= 60
assert sum(counts.values()) == len(bf16.probes)

# %%
# The matmul family and convolutions run in bf16 on every device autocast supports, and the
# probe saw autocast insert a float32 -> bf16 cast for them.
for op in ("matmul", "mm", "bmm", "linear", "conv2d"):
    assert bf16.kind(op) == policy.LOWER, op
    assert "float32->bfloat16" in bf16[op].casts, op
print(textwrap.fill("lower precision: " + ", ".join(bf16.ops(policy.LOWER)), 88))

# %%
# The full table, grouped by class
# --------------------------------
# Columns give the output dtype for float32, bf16 and mixed inputs, the casts autocast
# added, and the first error or warning any of the three calls raised.
bf16

# %%
# Probing fp16
# ------------
fp16 = policy.probe(dev, torch.float16)
for kind, n in fp16.counts().items():
    print(f"  {kind:<16} {n:>3}")
assert fp16.kind("matmul") == policy.LOWER

# %%
# Where bf16 and fp16 differ
# --------------------------
# An empty table means autocast treats both dtypes alike on this device.
diff = policy.differences(bf16, fp16)
print(f"{len(diff.rows)} ops change class between bf16 and fp16 on {dev.type}")
assert len(diff.rows) == sum(
    bf16.kind(p.op) != fp16.kind(p.op) for p in bf16.probes
)
diff

# %%
# On a GPU
# --------
# CUDA's autocast has its own op lists. A GPU build shows its live table above; here are the
# tables recorded on GPU machines by ``nox -s record``, each labelled with where, when and by
# which command it was measured.
from mpguide import record

record.beside(
    "autocast.policy.bfloat16",
    bf16.table() if dev.type == "cuda" else None,
    machine=device.describe(dev),
)

# %%
# The same table on your machine
# ------------------------------
# The command line prints it for any device and dtype your machine has::
#
#     python -m mpguide policy --device cpu --dtype bfloat16 --format markdown
#
# What we saw
# -----------
# - The counts per class printed above, for bf16 and fp16 on this build's device.
# - The matmul family and convolutions run in the low-precision dtype, with autocast
#   inserting the float32 -> low-precision casts.
# - The classes that differ between bf16 and fp16 are listed in the last table.
#
# .. admonition:: References
#
#    :torchdoc:`amp.html#autocast-op-reference`, :torchapi:`torch.autocast`,
#    :torchdoc:`notes/extending.html`
