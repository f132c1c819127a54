"""The train/serve logprob gap of reinforcement learning, knob by knob, on a tiny language model.

An RL trainer recomputes the logprobs of the tokens a serving engine sampled, and the ratio
``exp(logp_trainer - logp_server)`` weighs the update. The two sides run the same weights
through different precision: the trainer under autocast over float32 weights, the engine in
pure bf16 (or fp16) weights, with its own lm_head dtype, temperature and attention kernel.
:class:`Path` is one side's settings; :func:`logprobs` runs it; :func:`gap` compares two.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mpguide import MPGuideError


@dataclass(frozen=True)
class TinyLMConfig:
    """The shape of :class:`TinyLM`."""

    vocab: int = 4096
    width: int = 256
    heads: int = 4
    layers: int = 2
    logit_std: float = 3.0
    """Standard deviation of the initial logits: a trained LM's are peaked, not uniform."""


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.RMSNorm(cfg.width), nn.RMSNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.out = nn.Linear(cfg.width, cfg.width, bias=False)
        self.up = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
        self.down = nn.Linear(4 * cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Embedding, pre-norm transformer blocks with SDPA, a final RMSNorm and an lm_head."""

    def __init__(self, cfg: TinyLMConfig = TinyLMConfig(), seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(cfg.vocab, cfg.width)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
            self.norm = nn.RMSNorm(cfg.width)
            self.lm_head = nn.Linear(cfg.width, cfg.vocab, bias=False)
            nn.init.normal_(self.lm_head.weight, std=cfg.logit_std / cfg.width**0.5)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(tokens))


@dataclass(frozen=True)
class Path:
    """One side's precision: ``weights`` dtype of the model, ``autocast`` dtype (or none),
    the lm_head in float32 or the model's dtype, the temperature and the dtype it is applied
    in (``None``: float32, after ``logits.float()``), and the SDPA backend (``None``: the
    default choice)."""

    name: str
    weights: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    fp32_head: bool = False
    temperature: float = 1.0
    temperature_dtype: torch.dtype | None = None
    sdpa: SDPBackend | None = None


def logprobs(
    model: TinyLM, tokens: torch.Tensor, targets: torch.Tensor, path: Path
) -> torch.Tensor:
    """``log p(targets | tokens)`` per position under ``path``, in float64. The logits go
    through ``.float()`` before the log-softmax, as serving engines' samplers and RL trainers
    do."""
    m = model if path.weights == torch.float32 else copy.deepcopy(model).to(path.weights)
    kind = tokens.device.type
    attention = sdpa_kernel(path.sdpa) if path.sdpa is not None else nullcontext()
    cast = torch.autocast(kind, dtype=path.autocast) if path.autocast else nullcontext()
    with torch.no_grad(), attention, cast:
        h = m.hidden(tokens)
        if path.fp32_head:
            with torch.autocast(kind, enabled=False):
                logits = F.linear(h.float(), m.lm_head.weight.float())
        else:
            logits = m.lm_head(h)
    if path.temperature_dtype is not None:
        logits = (logits.to(path.temperature_dtype) / path.temperature).float()
    else:
        logits = logits.float() / path.temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()


def sample_targets(
    model: TinyLM, tokens: torch.Tensor, temperature: float, generator: torch.Generator
) -> torch.Tensor:
    """The token sampled at every position from the float32 model (teacher forced), as a
    rollout would have sampled it."""
    with torch.no_grad():
        probs = torch.softmax(model(tokens).double() / temperature, -1)
    flat = torch.multinomial(probs.flatten(0, 1), 1, generator=generator)
    return flat.view(tokens.shape)


@dataclass(frozen=True)
class Gap:
    """``trainer - server`` logprob differences over the sampled tokens, in nats."""

    trainer: str
    server: str
    mean_abs: float
    max_abs: float
    outside_band: float
    """Share of tokens whose ratio ``exp(diff)`` is off 1 by more than the band."""
    band: float


def gap(
    trainer: torch.Tensor, server: torch.Tensor, names: tuple[str, str], band: float = 0.01
) -> Gap:
    """Compare two paths' logprobs of the same tokens; ``band``: the ratio's tolerance."""
    if trainer.shape != server.shape:
        raise MPGuideError(f"shapes differ: {tuple(trainer.shape)} and {tuple(server.shape)}")
    diff = trainer - server
    ratio = diff.exp()
    return Gap(
        trainer=names[0],
        server=names[1],
        mean_abs=diff.abs().mean().item(),
        max_abs=diff.abs().max().item(),
        outside_band=((ratio - 1).abs() > band).double().mean().item(),
        band=band,
    )
