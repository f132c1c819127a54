"""
FSDP2's MixedPrecisionPolicy: readers' questions
================================================

Four questions about the dtypes ``fully_shard`` keeps, computes, reduces and returns under a
``MixedPrecisionPolicy``. FSDP2 runs for real here: one process, the gloo backend, the CPU, a
model of two blocks sharded block by block, with a dispatch-mode log of the ops. The answers
on this torch: the parameters you read outside the forward are the float32 shards, and the
forward sees bf16; ``reduce_dtype=None`` reduces in ``param_dtype`` (bf16), and float32 must
be asked for; the output keeps the compute dtype unless ``output_dtype`` is set; and one
``fully_shard`` group refuses parameters of two dtypes.
"""

# %%
# Setup
# -----
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mpguide import error_line
from mpguide.core import device, dtypes
from mpguide.core.table import Table
from mpguide.training import distributed

device.describe("cpu")
bf16, f32 = torch.bfloat16, torch.float32


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = torch.nn.Linear(8, 16)
        self.wo = torch.nn.Linear(16, 8)

    def forward(self, h):
        return self.wo(torch.relu(self.wq(h)))


def step(policy):
    """Shard two blocks and the root with ``policy`` (``fully_shard`` on each block, then on
    the root: :func:`mpguide.training.distributed.shard`), run one forward and backward, and
    report what each stage held."""
    torch.manual_seed(0)
    model = distributed.shard(torch.nn.Sequential(Block(), Block()), policy)
    seen = []
    model[0].wq.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.dtype))
    with dtypes.Log() as log:
        out = model(torch.randn(2, 8))
        out.float().sum().backward()
    weight = model[0].wq.weight
    reduce_in = [c.ins[-1] for c in distributed.reduce_scatter_inputs(log)]
    return {
        "parameter read outside forward": f"{type(weight).__name__} {dtypes.name(weight.dtype)}",
        "weight seen in forward": dtypes.name(seen[0]),
        "reduce-scatter input": ", ".join(sorted({dtypes.name(d) for d in reduce_in})),
        "block output": dtypes.name(out.dtype),
        "gradient": f"{type(weight.grad).__name__} {dtypes.name(weight.grad.dtype)}",
    }


policies = {
    "param bf16": MixedPrecisionPolicy(param_dtype=bf16),
    "param bf16, reduce float32": MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32),
    "param bf16, output float32": MixedPrecisionPolicy(param_dtype=bf16, output_dtype=f32),
}
with distributed.process_group():
    facts = {name: step(policy) for name, policy in policies.items()}
runs = Table(("policy", *next(iter(facts.values()))),
             tuple((name, *f.values()) for name, f in facts.items()),
             f"FSDP2, world size 1, gloo, cpu ({device.LIVE}), torch {torch.__version__}")
runs

# %%
# Why are my weights float32 with param_dtype=bf16?
# -------------------------------------------------
# Asked in `torchtitan#1027 <https://github.com/pytorch/torchtitan/issues/1027>`__ ("I am seeing
# Linear layer weights in float32 (``wq.weight.dtype torch.float32``) even after setting
# ``mixed_precision_param = "bfloat16"``") and
# `torchtitan#1028 <https://github.com/pytorch/torchtitan/pull/1028>`__. The first row above:
first = facts["param bf16"]
assert first["parameter read outside forward"] == "DTensor float32"
assert first["weight seen in forward"] == "bfloat16"
assert first["gradient"] == "DTensor float32"
print(f"on torch {torch.__version__}: outside the forward the weight is the float32 shard; "
      "inside, FSDP2 has swapped in an all-gathered bf16 copy")

# %%
# ``fully_shard`` replaces each parameter by a ``DTensor`` shard in the dtype it was created
# in, float32: that is the master copy the optimizer updates. Before each forward it
# all-gathers the shards, casts them to ``param_dtype`` and registers the bf16 result as the
# module's parameter until the forward (and again for the backward) is done; after it, the
# attribute points at the float32 shard again. Reading ``wq.weight.dtype`` in the training loop
# therefore shows float32: the policy is working. Read it in a forward pre-hook, as above.
# The whole flow, with the casts: :ref:`sphx_glr_docs_auto_examples_autograd_plot_05_grad_dtypes.py`.

# %%
# What does reduce_dtype default to?
# ----------------------------------
# Asked in `torchtune#2267 <https://github.com/meta-pytorch/torchtune/issues/2267>`__ ("we may want
# to hardcode ``reduce_dtype=torch.float32`` by default") and torchtitan's
# `#4597 <https://github.com/pytorch/torchtitan/pull/4597>`__,
# `#4434 <https://github.com/pytorch/torchtitan/pull/4434>`__ and
# `#4465 <https://github.com/pytorch/torchtitan/pull/4465>`__ (allowing bf16 reduction).
# The defaults of the policy, and the reduce-scatter input of the first two rows:
default = MixedPrecisionPolicy()
print({f: getattr(default, f) for f in ("param_dtype", "reduce_dtype", "output_dtype",
                                        "cast_forward_inputs")})
assert default.reduce_dtype is None
assert facts["param bf16"]["reduce-scatter input"] == "bfloat16"
assert facts["param bf16, reduce float32"]["reduce-scatter input"] == "float32"
assert facts["param bf16"]["gradient"] == facts["param bf16, reduce float32"]["gradient"]

# %%
# With ``reduce_dtype=None`` FSDP2 reduces the gradients in the dtype they were computed in,
# ``param_dtype``: bf16 here. The reduced gradient is then cast to the shard's float32, so
# the ``.grad`` the optimizer sees is float32 either way (last column), and what differs is
# the precision of the sum across ranks: a bf16 sum rounds each partial to 8 bits. Ask for
# ``reduce_dtype=torch.float32`` to sum in float32 (torchtitan's default; torchtune's
# hard-coded choice), at twice the bytes. The error of each choice across 2 ranks:
# :ref:`sphx_glr_docs_auto_examples_training_plot_05_distributed.py`.

# %%
# What dtype do FSDP2 block outputs have?
# ---------------------------------------
# Asked in `NeMo RL#4226 <https://github.com/NVIDIA-NeMo/RL/pull/4226>`__: "Both paths hard-code
# ``output_dtype=torch.float32``, so FSDP2 casts every unit's forward output to fp32: each
# wrapped decoder block returns fp32 hidden states". The output column above:
assert facts["param bf16"]["block output"] == "bfloat16"
assert facts["param bf16, output float32"]["block output"] == "float32"
print("output_dtype=None keeps the compute dtype; output_dtype=float32 casts every block's "
      "output")

# %%
# ``output_dtype`` casts each ``fully_shard`` unit's floating outputs after its forward; by
# default (``None``) they stay in ``param_dtype``. With ``cast_forward_inputs=True`` (the
# default) the next unit casts its inputs back to bf16 anyway, so a float32 output buys
# precision only for code that reads it outside the sharded units (a loss in float32), and
# costs the activations' memory in between, which is the thread's point.

# %%
# Can one fully_shard group hold parameters of different dtypes?
# --------------------------------------------------------------
# Asked in `pytorch#156784 <https://github.com/pytorch/pytorch/issues/156784>`__ ("allow
# different dtypes for the model params with gradients"), with the per-parameter policies of
# `#196626 <https://github.com/pytorch/pytorch/pull/196626>`__ and
# `#195946 <https://github.com/pytorch/pytorch/pull/195946>`__. A block whose second layer was
# cast to bf16, sharded as one group (``fully_shard(block)``), then each layer as its own group
# (:func:`mpguide.training.distributed.shard`: each layer, then the block as a root that holds
# no parameter of its own):
class MixedBlock(Block):
    """``wo`` in bf16; the forward casts its input to ``wo``'s dtype."""

    def __init__(self):
        super().__init__()
        self.wo.to(bf16)

    def forward(self, h):
        return self.wo(torch.relu(self.wq(h)).to(self.wo.weight.dtype))


def first_step(shard):
    """Shard a :class:`MixedBlock` with ``shard`` and run one forward and backward (FSDP2
    checks its groups lazily, at the first forward); the gradients' dtypes, or the error."""
    torch.manual_seed(0)
    block = MixedBlock()
    shard(block)
    try:
        block(torch.randn(2, 8)).float().sum().backward()
    except Exception as err:  # noqa: BLE001 -- the refusal is the finding
        return error_line(err)
    return (f"stepped: wq.grad {dtypes.name(block.wq.weight.grad.dtype)}, "
            f"wo.grad {dtypes.name(block.wo.weight.grad.dtype)}")


with distributed.process_group():
    groups = {"one group for both layers": first_step(fully_shard),
              "one group per layer": first_step(distributed.shard)}
groups

# %%
assert "FSDP expects uniform original parameter dtype" in groups["one group for both layers"]
assert groups["one group per layer"] == "stepped: wq.grad float32, wo.grad bfloat16"
print(f"on torch {torch.__version__}: a group with two parameter dtypes is refused; a group "
      "per dtype works")

# %%
# A ``fully_shard`` group all-gathers its parameters in one flat buffer and reduce-scatters
# its gradients in another, and each buffer has one dtype, so FSDP2 requires one original
# dtype per group and says so at the first forward (``AssertionError: FSDP expects uniform
# original parameter dtype but got {torch.float32, torch.bfloat16}``), not at
# ``fully_shard``. Shard the parameters of each dtype as their own group (a submodule per
# group, as above), or keep all parameters float32 and let ``param_dtype`` cast them; the
# per-parameter policies of the open pull requests would lift the restriction.

# %%
# What we saw
# -----------
# - Outside the forward FSDP2 parameters are float32 ``DTensor`` shards; the forward sees bf16.
# - ``reduce_dtype`` defaults to ``None``: reduction in ``param_dtype``; the ``.grad`` is
#   float32 either way.
# - ``output_dtype=None`` keeps bf16 outputs; ``float32`` casts every unit's output.
# - One ``fully_shard`` group needs one parameter dtype.
#
# .. admonition:: References
#
#    :torchdoc:`distributed.fsdp.fully_shard.html`,
#    :torchdoc:`distributed.html#torch.distributed.init_process_group`
