"""
Serving a trained model in fp32, bf16, fp16 or under autocast
=============================================================

You have a trained classifier: can you serve it in bf16, in fp16, or with float32 weights under
autocast, and what do you lose? We train a small transformer classifier here, run the same
inputs through each way of serving it with :func:`mpguide.models.inference.compare`, and measure the
error of the logits against fp32, how often the predicted class changes, parameter and peak
memory, and latency. The fastest variant that keeps the predictions is then compiled, and a
short decision guide is derived from the measured table.
"""

# %%
# Setup
# -----
# Everything runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present, else
# the CPU. On a shared machine (such as the one that built this page) latencies are disturbed
# by other jobs: the table flags noisy ones, and no latency relation is stated unless the
# gap between two medians exceeds both spreads.
import torch
from torch import nn

from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# A task and a model
# ------------------
# Each input is a sequence of 16 tokens drawn from 12; the label is the token among the
# first four classes that occurs most often (ties go to the smallest). The model embeds the
# tokens, runs two :class:`torch.nn.TransformerEncoder` layers and classifies the mean.
VOCAB, LENGTH, CLASSES, WIDTH = 12, 16, 4, 32


def task(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=gen)
    counts = torch.stack([(tokens == c).sum(1) for c in range(CLASSES)], 1)
    return tokens, counts.argmax(1)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(LENGTH, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(tokens) + self.position)
        return self.head(hidden.mean(1))


# %%
# Training for a few seconds
# --------------------------
# A fixed seed, 40 steps of AdamW on fresh batches of 32, in float32.
torch.manual_seed(0)
model = Classifier().to(dev)
gen = torch.Generator().manual_seed(0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(40):
    tokens, labels = task(32, gen)
    loss = nn.functional.cross_entropy(model(tokens.to(dev)), labels.to(dev))
    opt.zero_grad()
    loss.backward()
    opt.step()

test_tokens, test_labels = task(64, torch.Generator().manual_seed(1))
model.eval()
with torch.inference_mode():
    accuracy = (model(test_tokens.to(dev)).argmax(1).cpu() == test_labels).double().mean().item()
print(f"final training loss {loss.item():.3f}; fp32 accuracy on 64 test inputs: {accuracy:.1%}")
assert accuracy >= 0.85
assert all(p.dtype == torch.float32 for p in model.parameters())

# %%
# Five ways to serve it
# ---------------------
# :func:`mpguide.models.inference.standard` lists fp32; the model cast to bf16 and to fp16 (weights
# and activations in that dtype); and float32 weights under :func:`torch.autocast` with bf16
# (plus fp16 on CUDA). Each runs live on this machine's device under
# :func:`torch.inference_mode`, on the same 64 test inputs.
# Errors are the absolute difference of the logits from fp32's; "same class %" is the share of
# inputs whose predicted class matches fp32's; latencies are medians of interleaved rounds
# after warm-up, with the interquartile range.
from mpguide.models import inference

variants = inference.standard(dev)
[v.name for v in variants]

# %%
first = inference.compare(model, test_tokens, variants, dev, warmup=1, repeat=8)
first

# %%
# What holds regardless of the machine's load: casting the weights halves parameter memory,
# autocast does not shrink it at all, and the predictions survive the cast.
fp32 = first["fp32"]
for name in ("bf16 weights", "fp16 weights"):
    assert first[name].parameter_bytes * 2 == fp32.parameter_bytes, name
assert first["autocast bf16"].parameter_bytes == fp32.parameter_bytes
for r in first.results:
    assert r.nonfinite == 0, r.name
    assert r.agreement >= 0.95, r.name
print(f"fp32 parameters: {fp32.parameter_bytes / 2**10:.1f} KiB; "
      f"bf16 weights: {first['bf16 weights'].parameter_bytes / 2**10:.1f} KiB")

# %%
# fp16 has three more significand bits than bf16 (its machine epsilon is 8 times smaller), so
# the model cast to fp16, whose logits stayed finite, is closer to fp32 than the model cast to
# bf16.
eps_ratio = torch.finfo(torch.bfloat16).eps / torch.finfo(torch.float16).eps
assert eps_ratio == 2**3
bf16_err, fp16_err = first["bf16 weights"].mean_error, first["fp16 weights"].mean_error
print(f"mean |error| of the logits: bf16 weights {bf16_err:.2e}, fp16 weights {fp16_err:.2e}")
assert fp16_err < bf16_err

# %%
# Compiling the best variant
# --------------------------
# "Best" is measured, not assumed: the lowest median latency among the variants whose logits
# are finite and whose predicted class agrees with fp32 on at least 99% of inputs.
best = first.best(min_agreement=0.99)
print(f"best eager variant on {dev.type}: {best.name} "
      f"({best.latency.median * 1e3:.2f} ms median)")

# %%
# We compile it with :func:`torch.compile` (once; the first call pays for compilation) and
# time it against its eager twin and fp32 in a second run, so the three share the same load.
eager = [inference.Variant("fp32"), best.variant]
final = inference.compare(model, test_tokens, [*dict.fromkeys(eager), best.variant.compiled()],
                          dev, warmup=1, repeat=8)
compiled = final[best.variant.compiled().name]
assert compiled.output == best.output
assert compiled.agreement >= 0.99 and compiled.nonfinite == 0
final

# %%
# Error against latency
# ---------------------
# Each point is a variant: its median latency with a bar from the first to the third quartile,
# and the largest error of its logits against fp32 (fp32 itself sits at zero). Circles come
# from the first run, the square from the second run with the compiled variant.
from mpguide import plots

fig = plots.latency_error(
    [first.results, [compiled]], title=f"{first.items} inputs per pass, {first.machine.caption()}"
)
assert len(fig.axes[0].containers) == len(first.results) + 1

# %%
# A decision guide from these tables
# ----------------------------------
# The sentences below are generated from the measured first table by
# :func:`mpguide.models.inference.choices` (among the variants that keep 99% of fp32's predicted
# classes: the closest, the smallest, the fastest) and by :func:`mpguide.models.inference.guide`
# (each variant against fp32 of the same run). "Faster", "slower" and "ahead" are said only
# when the gap between two medians exceeds both interquartile ranges.
import textwrap


def show(sentences: list[str]) -> None:
    for sentence in sentences:
        print(textwrap.fill(sentence, 88, initial_indent="- ", subsequent_indent="  "))


picks = inference.choices(first, min_agreement=0.99)
show(picks)

# %%
# The choices restate the table; check them against the numbers again.
keep = [r for r in first.results if r.nonfinite == 0 and r.agreement >= 0.99]
ranked = sorted(keep, key=lambda r: r.latency.median)
lower = [r for r in keep if r.name != "fp32"]
if lower:
    closest = min(lower, key=lambda r: r.mean_error)
    assert picks[0].split(": ")[1].startswith(closest.name)
assert picks[-1].split(": ")[1].startswith(ranked[0].name)
if len(ranked) > 1:
    assert ("clearly ahead" in picks[-1]) == ranked[0].latency.clearly_below(ranked[1].latency)

# %%
# Each variant against fp32, in the first run and (for the compiled variant) the second:
lines = {}
for comparison in (first, final):
    for r, line in zip(comparison.results[1:], inference.guide(comparison), strict=True):
        base = comparison["fp32"]
        assert line.startswith(r.name)
        assert ("is faster" in line) == r.latency.clearly_below(base.latency)
        assert ("is slower" in line) == base.latency.clearly_below(r.latency)
        assert ("keeps fp32's" in line) == (r.parameter_bytes == base.parameter_bytes)
        lines.setdefault(r.name, line)
show(list(lines.values()))

# %%
# Recorded on a GPU
# -----------------
# The tables above were measured on the device this page was built on. Recordings made on
# GPU machines with ``nox -s record`` compare the same ways of serving a 4-layer, width-1024
# transformer encoder (``mpguide.core.record``), labelled with where, when and by which command
# they were measured.
from mpguide.core import record

record.beside("inference.variants")

# %%
# What we saw
# -----------
# - Casting the weights to bf16 or fp16 halves parameter memory; autocast keeps float32
#   weights, so its parameter memory equals fp32's (asserted).
# - Every variant kept the predicted class of fp32 on at least 95% of the test inputs, and
#   the fp16 cast was closer to fp32 than the bf16 cast (asserted).
# - Which variant is fastest depends on the device: the guide above names it for this
#   build's machine, and says which gaps are larger than the measurement noise.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchapi:`torch.compile`, :torchapi:`torch.inference_mode`,
#    :torchapi:`torch.nn.TransformerEncoder`, :torchapi:`torch.nn.Module` (``Module.to``),
#    :torchdoc:`amp.html`
