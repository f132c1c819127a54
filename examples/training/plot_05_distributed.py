"""
Gradient communication: DDP comm hooks and FSDP2 policies
=========================================================

In which dtype do gradients travel between ranks, and what does it cost them? We run one
training step of a small MLP in two processes on the CPU (gloo), with DDP without a comm hook
and with the built-in hooks that compress gradients to fp16 and bf16, and with FSDP2 under
several ``MixedPrecisionPolicy`` settings. A dispatch-mode log records the dtype and size of
every tensor handed to a collective, and each rank's own gradients give the references: the
mean of what the ranks computed (what communication alone changed) and the float64 gradient.
The answer: the hooks halve the bytes and leave float32 gradients on the parameters; fp16
compression is the more precise for gradients of ordinary size but flushes small ones to
zero, where bf16 keeps them at its coarser precision; FSDP2 all-gathers parameters in
``param_dtype`` and reduce-scatters gradients in ``reduce_dtype`` (a float32 reduction of bf16
gradients is exact), keeps gradient shards in the dtype of the model it sharded (float32 here,
since the MLP is float32), and returns the output in ``output_dtype``.
"""

# %%
# Setup
# -----
# Every measurement on this page runs on the CPU with the gloo backend, on any machine; NCCL
# needs GPUs, and what it does is not measured here.
import math

import torch
from torch import nn

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.training import autograd, distributed

device.describe("cpu")
bf16, fp16 = torch.bfloat16, torch.float16

# %%
# A comm hook in a world of one process
# -------------------------------------
# :func:`mpguide.training.distributed.process_group` starts a gloo group in this process, meeting in
# a file store in a temporary folder (so there is no port to pick), and destroys it after the
# block. DDP wraps a ``Linear``; we register the built-in compression hooks and log one
# backward pass with :class:`mpguide.training.autograd.DtypeLog`.
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


def ddp_with_fp16_hook() -> DistributedDataParallel:
    ddp = DistributedDataParallel(nn.Linear(4, 4))
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    return ddp


def logged_backward(ddp: DistributedDataParallel) -> autograd.DtypeLog:
    with autograd.DtypeLog() as log:
        ddp(torch.randn(2, 4)).sum().backward()
    return log


with distributed.process_group():
    try:
        DistributedDataParallel(nn.Linear(4, 4)).register_comm_hook(
            dist.group.WORLD, default_hooks.bf16_compress_hook
        )
        bf16_refused = None
    except TypeError as err:
        bf16_refused = str(err)
    ddp = ddp_with_fp16_hook()
    log = logged_backward(ddp)
    grad_dtype = ddp.module.weight.grad.dtype
assert not dist.is_initialized()
hook_ops = [r for r in log.records if r.is_cast or r.op.startswith("c10d.")]
Table(
    ("op", "dtypes"), tuple((r.op_name, r.signature()) for r in hook_ops),
    f"DDP with fp16_compress_hook, world of 1, gloo, torch {torch.__version__}",
)

# %%
# Live, on the CPU with gloo: the hook casts the gradient bucket to fp16, all-reduces that (even in
# a world of one, unlike FSDP2, which skips its collectives there; see the autograd chapter), and
# copies the result back into the float32 bucket: ``.grad`` stays float32. The bf16 hook is refused
# at registration on a torch built without CUDA (or XPU), whatever the backend.
#
# The copy back is a callback on the all-reduce's future. It runs on the thread that
# completes the all-reduce, gloo's own, unless the all-reduce was already done when the hook
# attached it; a dispatch mode such as ``DtypeLog`` sees only the thread that entered it. So
# the table above has the copy back only when it ran on this thread, and the page counts how
# often that happens over further backward passes of the same model.
TO_FP16, ALLREDUCE = ("aten._to_copy", "float32->float16"), ("c10d.allreduce_", "")
COPY_BACK = ("aten.copy_", "float16->float32")
assert [(r.op_name, r.cast) for r in hook_ops] in (
    [TO_FP16, ALLREDUCE],
    [TO_FP16, ALLREDUCE, COPY_BACK],
)
STEPS = 40
logged_here = 0
with distributed.process_group():
    ddp = ddp_with_fp16_hook()
    for _ in range(STEPS):
        step_casts = [(r.op_name, r.cast) for r in logged_backward(ddp).records if r.is_cast]
        assert step_casts in ([TO_FP16], [TO_FP16, COPY_BACK]), step_casts
        assert ddp.module.weight.grad.dtype == torch.float32
        logged_here += step_casts == [TO_FP16, COPY_BACK]
print(f"the copy back ran on this thread in {logged_here} of {STEPS} backward passes; "
      f"on gloo's thread, out of the log's sight, in {STEPS - logged_here}")
assert hook_ops[1].inputs[0].dtype == fp16 and grad_dtype == torch.float32
no_gpu_build = torch.version.cuda is None and torch.version.hip is None
if no_gpu_build:
    assert "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+" in bf16_refused
print(f"bf16_compress_hook on this build ({'no' if no_gpu_build else 'a'} GPU build): "
      f"{bf16_refused or 'accepted'}")

# %%
# One step in two processes
# -------------------------
# :func:`mpguide.training.distributed.communication` starts two worker processes (plain Python
# processes that import :mod:`mpguide`, so nothing from this page needs pickling), which meet in a
# file store and run one training step per setup of
# :data:`mpguide.training.distributed.COMM_SETUPS`, with the loss as it is and multiplied by
# ``1e-7`` (small gradients, as without loss scaling late in training). Where DDP refuses the bf16
# hook, the workers register it under another name, which the check does not know: gloo then runs
# it, and the note says so.
comm = distributed.communication(world_size=2, scales=(1.0, 1e-7))
comm

# %%
n_params = comm.parameters
ddp_runs = {setup: comm.get(setup) for setup in distributed.COMM_SETUPS if setup.startswith("DDP")}
for setup, run in ddp_runs.items():
    assert [c.op for c in run.collectives] == ["c10d.allreduce_"], setup
    assert run.grad_dtype == torch.float32 and run.out_dtype == torch.float32, setup
assert ddp_runs["DDP"].comm_dtypes == (torch.float32,)
assert ddp_runs["DDP"].nbytes == 4 * n_params
for setup, dt in (("DDP, fp16_compress_hook", fp16), ("DDP, bf16_compress_hook", bf16)):
    assert ddp_runs[setup].comm_dtypes == (dt,) and ddp_runs[setup].nbytes == 2 * n_params
assert ("DDP refused it" in ddp_runs["DDP, bf16_compress_hook"].note) == no_gpu_build
assert all(r.ranks_agree for r in comm.runs)
print(f"{n_params} parameters: DDP all-reduces {ddp_runs['DDP'].nbytes} bytes in float32, "
      f"{ddp_runs['DDP, fp16_compress_hook'].nbytes} with either hook")

# %%
# What compression did to the gradient
# ------------------------------------
# At the loss as it is, fp16's 10 mantissa bits give a smaller error than bf16's 7. With the
# loss multiplied by ``1e-7`` the gradients fall below fp16's smallest subnormal, and the
# fp16 hook delivers zeros; bf16, with float32's exponent range, keeps them at its usual
# precision. (A loss scale keeps gradients in fp16's range; see the loss-scaling page.)
mantissa = {d: round(-math.log2(torch.finfo(d).eps)) for d in (fp16, bf16)}
print(f"mantissa bits (torch.finfo): fp16 {mantissa[fp16]}, bf16 {mantissa[bf16]}")
small = 1e-7
error = {(setup, s): comm.get(setup, s) for setup in ddp_runs for s in (1.0, small)}
assert error["DDP", 1.0].comm_error.max_rel < 1e-6
assert error["DDP, fp16_compress_hook", 1.0].comm_error.max_rel < 1e-2
assert (error["DDP, bf16_compress_hook", 1.0].comm_error.max_rel
        > 4 * error["DDP, fp16_compress_hook", 1.0].comm_error.max_rel)
assert error["DDP, fp16_compress_hook", small].flushed > 0.9
assert error["DDP, bf16_compress_hook", small].flushed < 0.01
assert error["DDP, bf16_compress_hook", small].comm_error.max_rel < 0.1
for setup in ddp_runs:
    print(f"{setup}: communication error {error[setup, 1.0].comm_error.max_rel:.2g} at the "
          f"loss as it is, {error[setup, small].comm_error.max_rel:.2g} with the loss x {small:g} "
          f"({error[setup, small].flushed:.0%} of the gradient flushed to zero)")

# %%
# FSDP2's mixed-precision policy
# ------------------------------
# FSDP2 shards each ``Linear``'s parameters over the ranks, all-gathers them before forward and
# again before backward, and reduce-scatters the gradients. With ``param_dtype=bf16`` the
# all-gathers carry bf16; the reduce-scatter carries ``reduce_dtype``. The gradient shards on the
# parameters are float32 in every setup here, because the MLP is float32 when it is sharded: a
# model cast to bf16 before ``fully_shard`` gets bf16 shards, gradient shards and optimizer
# states whatever ``reduce_dtype`` is
# (:ref:`sphx_glr_docs_auto_examples_autograd_plot_05_grad_dtypes.py` runs both). The output is
# bf16 unless ``output_dtype`` says otherwise. Against the mean of the ranks' own bf16
# gradients, a float32 reduction is exact; a bf16 one rounds the sum.
fsdp = {setup: comm.get(setup) for setup in distributed.COMM_SETUPS if setup.startswith("FSDP2")}
plain_fsdp = fsdp["FSDP2"]
assert plain_fsdp.comm_dtypes == (torch.float32,)
for setup, run in fsdp.items():
    gathers = [c for c in run.collectives if c.op == "c10d._allgather_base_"]
    scatters = [c for c in run.collectives if c.op == "c10d._reduce_scatter_base_"]
    assert len(gathers) == 4 and len(scatters) == 2, setup
    assert run.grad_dtype == torch.float32, setup
    if setup != "FSDP2":
        assert {c.dtype for c in gathers} == {bf16}, setup
        assert sum(c.nbytes for c in gathers) * 2 == sum(
            c.nbytes for c in plain_fsdp.collectives if c.op == "c10d._allgather_base_")
    reduce_dtype = bf16 if setup.endswith("reduce bf16") else torch.float32
    assert {c.dtype for c in scatters} == {reduce_dtype}, setup
assert plain_fsdp.out_dtype == torch.float32
assert fsdp["FSDP2, param bf16, reduce float32"].out_dtype == bf16
assert fsdp["FSDP2, param bf16, reduce float32, output float32"].out_dtype == torch.float32
assert fsdp["FSDP2, param bf16, reduce float32"].comm_error.max_rel == 0
assert fsdp["FSDP2, param bf16, reduce bf16"].comm_error.max_rel > 1e-3
print(f"FSDP2 reduce-scatter in bf16: communication error "
      f"{fsdp['FSDP2, param bf16, reduce bf16'].comm_error.max_rel:.2g}; in float32: "
      f"{fsdp['FSDP2, param bf16, reduce float32'].comm_error.max_rel:g}. Against float64 both "
      f"are dominated by the bf16 forward and backward: "
      f"{fsdp['FSDP2, param bf16, reduce float32'].error.max_rel:.2g}")

# %%
# Bytes and errors side by side: the bytes each setup handed to its collectives in one step,
# by dtype, and the error communication added to the gradient at each loss scale.
from mpguide import plots

_ = plots.communication_costs(
    comm, title=f"one training step, 2 processes, gloo, cpu, torch {torch.__version__}"
)

# %%
# What we saw
# -----------
# - DDP all-reduces float32 gradient buckets (live, on the CPU with gloo); ``fp16_compress_hook``
#   and ``bf16_compress_hook`` cast the bucket down before the all-reduce and back into it after,
#   halving the bytes and leaving float32 gradients. The bf16 hook is refused on a build without
#   CUDA, whatever the backend; registered under another name, gloo runs it.
# - fp16 compression was the more precise of the two at the loss as it was, and flushed almost
#   every gradient to zero with the loss multiplied by ``1e-7``, where bf16 kept them.
# - FSDP2 all-gathers parameters in ``param_dtype`` before forward and before backward,
#   reduce-scatters gradients in ``reduce_dtype``, keeps float32 gradient shards (the MLP was
#   float32 when sharded; a bf16 model keeps bf16 ones), and returns
#   ``output_dtype`` (bf16 when unset, with bf16 parameters). A float32 reduction of the bf16
#   gradients was exact; a bf16 reduction rounded it.
# - Every rank held the same reduced gradient in every setup.
#
# .. admonition:: References
#
#    :torchdoc:`ddp_comm_hooks.html`, :torchdoc:`distributed.fsdp.fully_shard.html`,
#    :torchapi:`torch.nn.parallel.DistributedDataParallel`,
#    :torchdoc:`distributed.html#torch.distributed.init_process_group`
