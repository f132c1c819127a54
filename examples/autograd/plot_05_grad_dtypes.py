"""
Gradients of another dtype
==========================

Can a parameter hold a gradient of another dtype, and in which dtypes does FSDP2's
mixed-precision policy keep parameters, gradients, reductions and outputs? We assign ``.grad``
tensors of the wrong dtype, device and shape and keep each error; set
:attr:`torch.Tensor.grad_dtype` and run backward; cast a parameter between forward and
backward; then run FSDP2 (``fully_shard``) for real on the CPU, with the gloo backend at world
size 1, eagerly and under ``torch.compile``, logging the dtype of everything it touches. The
answer: ``.grad`` must match the parameter's ``grad_dtype``, which defaults to its dtype and can
be set to another dtype (backward then casts into it) or to ``None``; a parameter cast after
forward receives a gradient in the dtype forward saw; and FSDP2 keeps its shards, gradient
shards and optimizer states in the dtype the model had when it was sharded (float32 for a
float32 model, bf16 for a model cast to bf16 first, whatever ``reduce_dtype`` says), computes
forward and backward in ``param_dtype``, reduces in ``reduce_dtype`` and returns the output in
``output_dtype``.
"""

# %%
# Setup
# -----
import warnings

import torch

from mpguide.core import device, dtypes
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)
bf16 = torch.bfloat16
print(f"the .grad and grad_dtype cells run on {dev.type}; the FSDP2 cells on cpu with gloo")


def error_of(fn):
    """The message of the RuntimeError ``fn`` raises, or None."""
    try:
        fn()
    except RuntimeError as err:
        return str(err)
    return None


def first_sentence(message):
    return message.split(". ")[0] if message else "accepted"


# %%
# What ``.grad`` accepts
# ----------------------
# A float32 parameter of shape 4 x 3, and four tensors assigned to its ``.grad``.
param = torch.nn.Parameter(torch.randn(4, 3, device=dev))


def assign(grad):
    def run():
        param.grad = grad

    message = error_of(run)
    param.grad = None
    return message


other_device = torch.device("meta")
offers = {
    "float32, 4 x 3": torch.zeros(4, 3, device=dev),
    "bfloat16, 4 x 3": torch.zeros(4, 3, device=dev, dtype=bf16),
    "float64, 4 x 3": torch.zeros(4, 3, device=dev, dtype=torch.float64),
    "float32, 3 x 4": torch.zeros(3, 4, device=dev),
    f"float32, 4 x 3, on {other_device.type}": torch.zeros(4, 3, device=other_device),
}
refused = {name: assign(grad) for name, grad in offers.items()}
Table(
    ("assigned to .grad of a float32 4 x 3 parameter", "result (first sentence)"),
    tuple((name, first_sentence(message)) for name, message in refused.items()),
    f"torch {torch.__version__}, parameter on {dev.type}",
)

# %%
# The stable part of each message is asserted: a dtype error names the ``grad_dtype``, and
# says how to change it.
assert refused["float32, 4 x 3"] is None
for name in ("bfloat16, 4 x 3", "float64, 4 x 3"):
    assert "attempting to assign a gradient with dtype" in refused[name], name
    assert "to a tensor with grad_dtype 'Float'" in refused[name], name
    assert "You can set the tensor's grad_dtype attribute" in refused[name], name
assert "attempting to assign a gradient of size '[3, 4]'" in refused["float32, 3 x 4"]
assert (
    "attempting to assign a gradient with device type 'meta'"
    in refused[f"float32, 4 x 3, on {other_device.type}"]
)
print(refused["bfloat16, 4 x 3"])

# %%
# ``Tensor.grad_dtype``
# ---------------------
# This torch has a ``grad_dtype`` attribute on tensors. It defaults to the tensor's dtype.
# Set to bf16, ``.grad`` accepts bf16 and refuses float32, and backward, whose gradient for a
# float32 forward arrives in float32, casts it to bf16 as it accumulates. Set to ``None``, any
# dtype is accepted: backward stores the incoming float32 gradient as it is, and accumulates
# into a bf16 ``.grad`` that is already there without changing its dtype.
has_grad_dtype = hasattr(torch.Tensor, "grad_dtype")
print(f"torch.Tensor has grad_dtype: {has_grad_dtype}")
assert has_grad_dtype, "this torch has no Tensor.grad_dtype: the cells below need rewriting"

gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(2, 4, device=dev, generator=gen)


def backward_into(p):
    (x @ p).sum().backward()
    return p.grad


w = torch.nn.Parameter(torch.randn(4, 3, device=dev, generator=gen))
float32_grad = backward_into(w).clone()
default_grad_dtype = w.grad_dtype
w.grad = None

w.grad_dtype = bf16
bf16_accepted = error_of(lambda: setattr(w, "grad", torch.zeros(4, 3, device=dev, dtype=bf16)))
float32_refused = error_of(lambda: setattr(w, "grad", torch.zeros(4, 3, device=dev)))
w.grad = None
into_bf16 = backward_into(w)

w.grad = None
w.grad_dtype = None
fresh_none = backward_into(w).dtype
w.grad = torch.zeros(4, 3, device=dev, dtype=bf16)
onto_bf16_none = backward_into(w).dtype
w.grad = None

with warnings.catch_warnings():  # setting it on a non-leaf also warns about reading .grad
    warnings.simplefilter("ignore", UserWarning)
    non_leaf = error_of(lambda: setattr(w * 2, "grad_dtype", bf16))
w.grad = torch.zeros(4, 3, device=dev)
w.grad_dtype = torch.float32
with_grad_there = error_of(lambda: setattr(w, "grad_dtype", bf16))
Table(
    ("grad_dtype", "what happened", "dtype of .grad"),
    (
        (f"default ({default_grad_dtype})", "backward", float32_grad.dtype),
        ("bfloat16", "assign a bf16 .grad", "accepted" if bf16_accepted is None else "refused"),
        ("bfloat16", "assign a float32 .grad", first_sentence(float32_refused)),
        ("bfloat16", "backward (float32 forward)", into_bf16.dtype),
        ("None", "backward, no .grad yet", fresh_none),
        ("None", "backward onto a bf16 .grad", onto_bf16_none),
        ("set on a non-leaf", "", first_sentence(non_leaf)),
        ("float32 -> bfloat16 with a float32 .grad there", "", first_sentence(with_grad_there)),
    ),
    f"a float32 4 x 3 parameter on {dev.type}",
)

# %%
assert default_grad_dtype == torch.float32
assert bf16_accepted is None
assert "with dtype 'float' to a tensor with grad_dtype 'BFloat16'" in float32_refused
assert into_bf16.dtype == bf16 and torch.equal(into_bf16, float32_grad.to(bf16))
assert fresh_none == torch.float32 and onto_bf16_none == bf16
assert non_leaf == "grad_dtype can only be set on leaf tensors."
assert "because there is already a gradient with dtype 'float'" in with_grad_there
print("grad_dtype=bf16: backward's float32 gradient is rounded to bf16 as it accumulates")

# %%
# A parameter cast between forward and backward
# ---------------------------------------------
# Forward runs a float32 ``Linear``; then the weight is cast to bf16, by replacing its
# ``.data`` or with ``module.to(bfloat16)`` (which, by default, does the same to the same
# parameter object). Backward still runs the float32 graph: the gradient arrives in float32
# on a parameter that is now bf16, whose ``grad_dtype`` has followed it to bf16. Assigning that
# same gradient by hand would be refused.


def cast_after_forward(cast):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3, device=dev)
    weight = lin.weight
    out = lin(torch.randn(2, 4, device=dev)).sum()
    cast(lin)
    out.backward()
    grad = weight.grad
    reassign = error_of(lambda: setattr(weight, "grad", grad.clone()))
    return weight.dtype, grad.dtype, weight.grad_dtype, reassign, lin.weight is weight


def by_data(lin):
    lin.weight.data = lin.weight.data.to(bf16)


casts = {"weight.data = weight.data.to(bf16)": by_data, "module.to(bf16)": lambda m: m.to(bf16)}
after_cast = {name: cast_after_forward(fn) for name, fn in casts.items()}
Table(
    (
        "cast after forward",
        "parameter",
        ".grad",
        "grad_dtype",
        "same .grad assigned by hand",
        "same parameter object",
    ),
    tuple((name, *row[:3], first_sentence(row[3]), row[4]) for name, row in after_cast.items()),
    f"float32 Linear, cast before backward, on {dev.type}",
)

# %%
for name, (p_dtype, g_dtype, g_expected, reassign, same) in after_cast.items():
    assert (p_dtype, g_dtype, g_expected) == (bf16, torch.float32, bf16), name
    assert "with dtype 'float' to a tensor with grad_dtype 'BFloat16'" in reassign, name
    assert same, name
print("after a cast between forward and backward, a bf16 parameter holds a float32 .grad")

# %%
# FSDP2's mixed-precision policy, run for real
# --------------------------------------------
# A process group of one rank (:func:`mpguide.training.distributed.process_group`: gloo, a
# :class:`torch.distributed.FileStore` in a temporary folder) runs on the CPU in every build.
# Two blocks of two ``Linear`` layers are sharded block by block
# (:func:`mpguide.training.distributed.shard`: ``fully_shard`` on each block, then on the
# root) with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32,
# output_dtype=...)``. A forward pre-hook records the weight each ``Linear`` sees, a
# :class:`mpguide.core.dtypes.Log` (a dispatch mode) logs every op with its dtypes, ``out=``
# tensors last among the inputs, and the parameters and gradients are read after backward.
from collections import Counter

from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from mpguide.training import distributed


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, h):
        return self.fc2(torch.relu(self.fc1(h)))


def policy(output_dtype):
    return MixedPrecisionPolicy(
        param_dtype=bf16, reduce_dtype=torch.float32, output_dtype=output_dtype
    )


def sharded_model(output_dtype):
    torch.manual_seed(0)
    return distributed.shard(torch.nn.Sequential(Block(), Block()), policy(output_dtype))


with distributed.process_group():
    model = sharded_model(torch.float32)
    sharded = model[0].fc1.weight
    seen_in_forward = []
    model[0].fc1.register_forward_pre_hook(
        lambda mod, args: seen_in_forward.append(
            (type(mod.weight), mod.weight.dtype, args[0].dtype)
        )
    )
    with dtypes.Log() as log:
        out = model(torch.randn(2, 8))
        out.sum().backward()
    grad = sharded.grad
    eager = {
        "sharded parameter": f"{type(sharded).__name__}, local shard "
        f"{dtypes.name(sharded.to_local().dtype)}, {sharded.placements}",
        "parameter seen in forward": f"{seen_in_forward[0][0].__name__}, "
        f"{dtypes.name(seen_in_forward[0][1])}",
        "input seen by the first Linear": dtypes.name(seen_in_forward[0][2]),
        "output (output_dtype=float32)": dtypes.name(out.dtype),
        "gradient": f"{type(grad).__name__}, local shard "
        f"{dtypes.name(grad.to_local().dtype)}",
    }
    eager_facts = (
        type(sharded),
        sharded.to_local().dtype,
        seen_in_forward[0],
        out.dtype,
        type(grad),
        grad.to_local().dtype,
    )
    reduce_inputs = distributed.reduce_scatter_inputs(log)
    ops = Counter(c.op for c in log.calls)
    collectives = sorted(
        op for op in ops if "c10d" in op or "all_gather" in op or "reduce_scatter" in op
    )
    bf16_to_float32 = sum(
        1
        for c in log.calls
        if c.op == "aten._to_copy.default" and c.conversion == (bf16, torch.float32)
    )

    default_out = sharded_model(None)(torch.randn(2, 8)).dtype

Table(
    ("what", "type and dtype"),
    (*eager.items(), ("output (output_dtype=None)", dtypes.name(default_out))),
    "FSDP2 at world size 1, gloo, cpu, MixedPrecisionPolicy(param_dtype=bf16, "
    "reduce_dtype=float32)",
)

# %%
# The reduction: FSDP2 copies each block's bf16 gradients into one reduce-scatter input in
# ``reduce_dtype`` (``fsdp.chunk_cat`` with bf16 inputs and a float32 ``out``). At world size
# 1 no collective runs: the log holds no communication op, and the reduce-scatter becomes a
# float32 copy.
for call in reduce_inputs:
    print(f"{call.op}: inputs {[dtypes.name(d) for d in call.ins]}")
print(f"communication ops in the log: {collectives or 'none'}; {len(log.calls)} ops in all")

# %%
assert eager_facts[0] is DTensor and eager_facts[1] == torch.float32
assert eager_facts[2] == (torch.nn.Parameter, bf16, bf16)
assert eager_facts[3] == torch.float32 and default_out == bf16
assert eager_facts[4] is DTensor and eager_facts[5] == torch.float32
assert len(reduce_inputs) == 2
for call in reduce_inputs:
    assert call.ins[:-1] == (bf16,) * (len(call.ins) - 1) and call.ins[-1] == torch.float32
assert collectives == []
assert bf16_to_float32 >= 2
print("float32 shards, bf16 forward, float32 reduction input and gradient, float32 output")

# %%
# The float32 shards come from the model, not from the policy
# ------------------------------------------------------------
# ``fully_shard`` shards the parameters in the dtype it finds them in; ``param_dtype`` only sets
# the dtype of the copies it all-gathers for forward and backward. A model cast to bf16 before
# ``fully_shard`` (``model.to(torch.bfloat16)``, or loaded in bf16) therefore gets bf16 shards,
# and the float32 ``reduce_dtype`` changes only the reduction: the reduced gradient is cast back
# into a bf16 gradient shard, and AdamW keeps bf16 states. The same two blocks, same policy,
# cast to bf16 first, live at world size 1 on gloo, with one AdamW step of learning rate 1e-4:


def one_step(cast_first):
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Block(), Block())
    blocks = blocks.to(bf16) if cast_first else blocks
    model = distributed.shard(blocks, policy(None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with dtypes.Log() as step_log:
        model(torch.randn(2, 8)).float().sum().backward()
    weight = model[0].fc1.weight
    before = [p.to_local().detach().clone() for p in model.parameters()]
    opt.step()
    state = opt.state[weight]
    after = [p.to_local() for p in model.parameters()]
    moved = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
    kept = (weight.to_local(), weight.grad.to_local(), state["exp_avg"], state["exp_avg_sq"])
    return {
        "shard": weight.to_local().dtype,
        "reduce-scatter input": distributed.reduce_scatter_inputs(step_log)[0].ins[-1],
        "gradient shard": weight.grad.to_local().dtype,
        "AdamW exp_avg, exp_avg_sq": (state["exp_avg"].dtype, state["exp_avg_sq"].dtype),
        "bytes per parameter kept": sum(t.element_size() for t in kept),
        "parameters the step changed": (moved, sum(b.numel() for b in before)),
    }


with distributed.process_group():
    as_built, cast_first = one_step(False), one_step(True)
Table(
    ("what", "float32 model", "model cast to bf16 first"),
    tuple(
        (what, *(str(run[what]).replace("torch.", "") for run in (as_built, cast_first)))
        for what in as_built
    ),
    "FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32), world size 1, gloo, "
    "cpu (live)",
)

# %%
f32 = torch.float32
assert (as_built["shard"], as_built["gradient shard"]) == (f32, f32)
assert as_built["AdamW exp_avg, exp_avg_sq"] == (f32, f32)
assert (cast_first["shard"], cast_first["gradient shard"]) == (bf16, bf16)
assert cast_first["AdamW exp_avg, exp_avg_sq"] == (bf16, bf16)
assert as_built["reduce-scatter input"] == cast_first["reduce-scatter input"] == f32
assert as_built["bytes per parameter kept"] == 2 * cast_first["bytes per parameter kept"] == 16
moved_f32, total = as_built["parameters the step changed"]
moved_bf16, _ = cast_first["parameters the step changed"]
assert moved_f32 == total and moved_bf16 < total / 2
print(
    f"cast to bf16 before fully_shard: bf16 shards, gradients and AdamW states even with "
    f"reduce_dtype=float32; {cast_first['bytes per parameter kept']} bytes a parameter instead "
    f"of {as_built['bytes per parameter kept']}, and one AdamW step at lr 1e-4 changed "
    f"{moved_bf16} of {total} parameters (float32 shards: {moved_f32})"
)

# %%
# The cost of the cast: half the memory for shards, gradients and optimizer states, and no
# float32 master weights, so updates smaller than half a bf16 spacing are lost (the count above;
# :ref:`sphx_glr_docs_auto_examples_autograd_plot_04_master_weights.py`). Keep the model float32
# when it is sharded and let ``param_dtype`` give the bf16 compute.

# %%
# The same as two strips, in the order the data flows: each box a stage, coloured by its dtype,
# outlined where FSDP2 changed the dtype of the stage before.
from mpguide import plots


def flow(*stages):
    """``(stage, dtype)`` pairs as strip boxes, a conversion where the dtype changes."""
    return [(name, dt, i > 0 and dt != stages[i - 1][1]) for i, (name, dt) in enumerate(stages)]


_ = plots.dtype_strips(
    {
        "parameters and gradients": flow(
            ("shard", eager_facts[1]),
            ("in forward", eager_facts[2][1]),
            ("gradient", reduce_inputs[0].ins[0]),
            ("reduce-scatter input", reduce_inputs[0].ins[-1]),
            ("gradient shard", eager_facts[5]),
        ),
        "activations (output_dtype=float32)": flow(
            ("model input", torch.get_default_dtype()),
            ("first Linear's input", eager_facts[2][2]),
            ("model output", eager_facts[3]),
        ),
    },
    title="FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32), world size 1, "
    f"cpu, torch {torch.__version__}",
)

# %%
# FSDP2 under ``torch.compile``
# -----------------------------
# The same model, first with each block compiled before it is sharded (the usual recipe),
# then with the whole sharded model compiled. The backend is AOTAutograd without a code
# generator (``aot_eager``), wrapped so that it records the dtypes of every forward and
# backward graph's inputs and outputs.
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

graphs = []


def recorder(kind):
    def compiler(gm, example_inputs):
        outs = gm.graph.find_nodes(op="output")[0].args[0]
        graphs[-1][kind].append(
            (
                [t.dtype for t in example_inputs if isinstance(t, torch.Tensor)],
                [
                    n.meta["val"].dtype
                    for n in outs
                    if hasattr(n, "meta") and isinstance(n.meta.get("val"), torch.Tensor)
                ],
            )
        )
        return make_boxed_func(gm)

    return compiler


backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))


def compiled_run(how):
    graphs.append({"how": how, "forward": [], "backward": []})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    if how == "each block":
        for block in model:
            block.compile(backend=backend)
    distributed.shard(model, policy(torch.float32))
    run = torch.compile(model, backend=backend) if how == "whole model" else model
    out = run(torch.randn(2, 8))
    out.sum().backward()
    breaks = [reason.split("\n")[0] for reason in torch._dynamo.utils.counters["graph_break"]]
    return out.dtype, model[0].fc1.weight.grad.to_local().dtype, breaks


with distributed.process_group():
    try:
        with warnings.catch_warnings():
            # Dynamo asks each graph input, among them bf16 tensors FSDP2 made (not leaves),
            # whether it has a .grad; it hides that warning with a filter that does not hold
            # where warnings are errors, as in this site's build.
            warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
            compiled = {how: compiled_run(how) for how in ("each block", "whole model")}
    finally:
        torch._dynamo.reset()


def listed(seq):
    return ", ".join(sorted({dtypes.name(d) for d in seq}))


rows = []
for record in graphs:
    out_dtype, grad_dtype, breaks = compiled[record["how"]]
    for kind in ("forward", "backward"):
        for ins, outs in record[kind]:
            rows.append(
                (
                    record["how"],
                    kind,
                    listed(ins),
                    listed(outs),
                    dtypes.name(out_dtype),
                    dtypes.name(grad_dtype),
                )
            )
Table(
    ("compiled", "graph", "graph inputs", "graph outputs", "model output", "gradient shard"),
    tuple(rows),
    "FSDP2 under torch.compile (AOTAutograd, no code generation), cpu, world size 1",
)

# %%
# Compiling the whole model graph-breaks where FSDP2's hooks start: they are wrapped in
# ``torch._dynamo.disable`` and run eagerly, so the casts to bf16 and back to float32 stay
# outside every graph, and the blocks are compiled on their own either way.
for how, (_, _, breaks) in compiled.items():
    print(f"{how}: {len(breaks)} graph break(s) {breaks}")

# %%
for record in graphs:
    out_dtype, grad_dtype, _ = compiled[record["how"]]
    assert len(record["forward"]) == len(record["backward"]) == 2, record["how"]
    for ins, outs in record["forward"] + record["backward"]:
        assert set(ins) == {bf16} and set(outs) == {bf16}, record["how"]
    assert out_dtype == torch.float32 and grad_dtype == torch.float32
assert compiled["each block"][2] == []
# Dynamo words the break differently from release to release ("marked as skipped", later
# "Call to `torch._dynamo.disable()`"); the behaviour checked is that the whole model breaks.
assert compiled["whole model"][2], "compiling the whole model did not graph-break"
print("compiled: bf16 in and out of every graph; float32 output and gradient shards")

# %%
# What we saw
# -----------
# - ``.grad`` refuses a gradient of another dtype (naming the ``grad_dtype``), shape or
#   device.
# - ``grad_dtype`` defaults to the parameter's dtype. Set to bf16, backward rounds the
#   float32 gradient to bf16 as it accumulates; set to ``None``, any dtype is accepted and a
#   fresh gradient keeps the dtype backward produced. It is refused on non-leaves and while a
#   gradient of another dtype is stored.
# - Casting a parameter to bf16 between forward and backward, by ``.data`` or ``module.to``,
#   leaves a float32 gradient on a bf16 parameter, one that assigning by hand would refuse.
# - FSDP2 with ``param_dtype=bf16, reduce_dtype=float32``, at world size 1 on gloo: float32
#   DTensor shards, bf16 ``Parameter`` and input in forward, bf16 gradients cast into a float32
#   reduce-scatter input (no collective runs at world size 1), float32 gradient shards, and an
#   output in ``output_dtype`` (bf16 when it is ``None``). A model cast to bf16 before
#   ``fully_shard`` keeps bf16 shards, gradient shards and AdamW states under the same policy:
#   half the bytes, and most of a small step's updates lost (the counts printed above).
# - Under ``torch.compile`` the graphs take and give only bf16; FSDP2's hooks stay outside
#   them, and compiling the whole model graph-breaks at them.
#
# .. admonition:: References
#
#    :torchapi:`torch.Tensor.grad`, :torchdoc:`distributed.fsdp.fully_shard.html`,
#    :torchdoc:`distributed.html#torch.distributed.init_process_group`,
#    :torchapi:`torch.compile`, :torchdoc:`notes/autograd.html`
