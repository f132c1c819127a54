"""
The precision switches: defaults, mapping and mixing
====================================================

Which fp32 precision does the installed torch use by default for matmuls, cuDNN
convolutions and the CPU (oneDNN) backend? How do ``set_float32_matmul_precision`` and the
``allow_tf32`` flags map onto the newer ``torch.backends.fp32_precision`` tree, and what
happens when code mixes the two APIs? We read every switch, apply each call on its own
(restoring everything afterwards with :func:`mpguide.core.switches.precision`), record what it
wrote, and check on this build's device whether a setting changes any result at all.
"""

# %%
# Setup
# -----
import textwrap

import torch

from mpguide import MPGuideError
from mpguide.core import device, state, switches
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)

# %%
# The defaults
# ------------
# The ``fp32_precision`` tree has a root (``torch.backends.fp32_precision``), one node per
# backend (``cudnn`` stands for all of CUDA, ``mkldnn`` for oneDNN on the CPU) and one leaf
# per op. ``none`` means: inherit from the parent. Beside it, the legacy getters.
defaults = switches.tree()
legacy = switches.legacy()
Table(
    ("switch", "value"),
    tuple((f"torch.backends.{p}", v) for p, v in defaults.items())
    + tuple((name, v) for name, v in legacy.items()),
    f"Precision switches at start-up, torch {torch.__version__}",
)

# %%
# What the installed torch starts with, read live in this process and asserted: IEEE fp32 for
# matmuls everywhere (the root, CUDA matmul and oneDNN inherit ``none``), but cuDNN convolutions and
# RNNs are allowed TF32.
inheriting = [p for p, v in defaults.items() if v == "none"]
assert defaults["cudnn.conv.fp32_precision"] == defaults["cudnn.rnn.fp32_precision"] == "tf32"
assert set(inheriting) == set(defaults) - {"cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision"}
assert legacy == {
    "torch.get_float32_matmul_precision()": "highest",
    "cuda.matmul.allow_tf32": "False",
    "cudnn.allow_tf32": "True",
}
print(f"{len(inheriting)} of {len(defaults)} switches inherit; TF32 is on for cuDNN conv and RNN")

# %%
# What each call writes
# ---------------------
# Each row starts from the defaults above, applies one call, lists the switches of the tree
# that changed, what the legacy getters read afterwards, and any warning raised.
M = switches.MATMUL_PRECISION
calls = [
    (M, "highest"),
    (M, "high"),
    (M, "medium"),
    ("cuda.matmul.allow_tf32", True),
    ("cudnn.allow_tf32", False),
    ("fp32_precision", "ieee"),
    ("fp32_precision", "tf32"),
    ("fp32_precision", "bf16"),
    ("cuda.matmul.fp32_precision", "tf32"),
    ("mkldnn.matmul.fp32_precision", "bf16"),
]
writes = switches.changes(calls)
writes

# %%
# The legacy calls write through to the tree (read live after each call): ``high`` means TF32 for
# CUDA and oneDNN matmuls, ``medium`` means TF32 on CUDA and bf16 on oneDNN, ``allow_tf32`` sets the
# CUDA leaves. Turning cuDNN's TF32 off writes ``none``, not ``ieee``.
high = writes["torch.set_float32_matmul_precision('high')"]
medium = writes["torch.set_float32_matmul_precision('medium')"]
assert (
    high.wrote("cuda.matmul.fp32_precision") == high.wrote("mkldnn.matmul.fp32_precision") == "tf32"
)
assert medium.wrote("cuda.matmul.fp32_precision") == "tf32"
assert medium.wrote("mkldnn.matmul.fp32_precision") == "bf16"
assert writes["torch.backends.cuda.matmul.allow_tf32 = True"].changed == (
    ("cuda.matmul.fp32_precision", "none", "tf32"),
)
cudnn_off = writes["torch.backends.cudnn.allow_tf32 = False"]
assert (
    cudnn_off.wrote("cudnn.conv.fp32_precision")
    == cudnn_off.wrote("cudnn.rnn.fp32_precision")
    == "none"
)
assert all(not item.warnings for item in writes.items)
print("no call above raised a warning")

# %%
# Mixing the APIs
# ---------------
# Setting the tree does not update the legacy values torch keeps beside it, and reading a
# legacy getter that disagrees raises instead of answering.
root_tf32 = writes["torch.backends.fp32_precision = 'tf32'"]
refused = [name for name, v in root_tf32.legacy if v == "raises RuntimeError"]
assert refused == ["torch.get_float32_matmul_precision()", "cuda.matmul.allow_tf32"]
with switches.precision({"cuda.matmul.fp32_precision": "tf32"}):
    try:
        torch.backends.cuda.matmul.allow_tf32
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError("reading the legacy flag after the new API should raise")
assert "mix of the legacy and new APIs" in message
print(textwrap.fill(message, 88))

# %%
# Legacy first, then the new API, agrees: the legacy call left matching values behind.
with switches.precision({M: "high", "cuda.matmul.fp32_precision": "tf32"}):
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"
print("set_float32_matmul_precision('high') then cuda.matmul.fp32_precision = 'tf32': consistent")

# %%
# Parents and children
# --------------------
# Setting a parent rewrites the children that inherited from it, and leaves alone a child
# set on its own. So after ``cudnn.allow_tf32 = False`` (which wrote ``none``), setting the
# root to TF32 turns cuDNN convolutions back to TF32.
leaves = (
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "cudnn.conv.fp32_precision",
)
rows = []
for path, value in (("mkldnn.matmul.fp32_precision", "ieee"), ("cudnn.allow_tf32", False)):
    with switches.precision({path: value}):
        before = switches.tree()
        with switches.precision({"fp32_precision": "tf32"}):
            after = switches.tree()
    changes = (f"{before[p]} -> {after[p]}" for p in leaves)
    rows.append((switches.describe(path, value), *changes))
own, cudnn_off = rows
assert own[1] == "ieee -> ieee" and own[2] == "none -> tf32"
assert cudnn_off[3] == "none -> tf32"
Table(
    ("first call", *(p.removesuffix(".fp32_precision") for p in leaves)),
    tuple(rows),
    "Leaves before and after torch.backends.fp32_precision = 'tf32'",
)

# %%
# CUDA has no bf16 mode for fp32 matmuls: the setter refuses it, live in this process (setting a
# switch needs no GPU).
try:
    with switches.precision({"cuda.matmul.fp32_precision": "bf16"}):
        pass
except MPGuideError as err:
    refusal = str(err)
assert "does not support precision 'bf16'" in refusal
assert state.get("cuda.matmul.fp32_precision") == defaults["cuda.matmul.fp32_precision"]
print(refusal)

# %%
# Does a switch change anything here?
# -----------------------------------
# :func:`mpguide.core.switches.effect` runs a matmul and a convolution in IEEE fp32 and with the
# setting, and compares bit for bit. On hardware without TF32 or bf16 units the switches are
# accepted and change nothing.
settings = [
    {"fp32_precision": "tf32"},
    {"fp32_precision": "bf16"},
    {M: "medium"},
    {"cuda.matmul.fp32_precision": "tf32"},
    {"mkldnn.matmul.fp32_precision": "bf16"},
]
effects = [switches.effect(s, dev) for s in settings]
assert all(e.reproducible for e in effects)
if dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0):
    assert "matmul" in effects[0].changed and "matmul" in effects[3].changed
if dev.type == "cuda":
    assert effects[4].changed == ()
print(
    f"{sum(bool(e.changed) for e in effects)} of {len(effects)} settings changed a result "
    f"on {dev.type}"
)
Table(
    ("setting", "verdict"),
    tuple((e.call, e.verdict) for e in effects),
    f"Switches against IEEE fp32, bit for bit, on {dev.type}",
)

# %%
# The same verdicts as a map: a grey cell is a probe whose result stayed bit-identical to IEEE
# fp32 under the setting, an orange one changed, labelled with its largest relative difference.
from matplotlib.colors import to_hex

from mpguide import plots

fig = plots.switch_effects(effects)
orange = [p for p in fig.axes[0].patches if to_hex(p.get_facecolor()) == plots.CAST_COLOUR]
assert len(orange) == sum(len(e.changed) for e in effects)

# %%
# What we saw
# -----------
# - This torch starts with IEEE fp32 matmuls and TF32 cuDNN convolutions and RNNs.
# - ``set_float32_matmul_precision`` and the ``allow_tf32`` flags write into the
#   ``fp32_precision`` tree; the tree does not write back, and a legacy getter that disagrees
#   with it raises a ``RuntimeError`` about mixing the APIs. No call warned.
# - Setting a parent rewrites inheriting children only; CUDA refuses ``bf16``.
# - Whether a switch does anything depends on the hardware: the last table says, bit for bit.
#
# .. admonition:: References
#
#    :torchdoc:`notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices`,
#    :torchapi:`torch.set_float32_matmul_precision`, :torchdoc:`backends.html`
