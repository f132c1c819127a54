"""Small models built from a config with random weights, for the examples and tests: nothing
is downloaded. Needs ``transformers``."""

from __future__ import annotations

from typing import Any

import torch


def qwen2(
    *,
    hidden: int = 64,
    intermediate: int = 128,
    layers: int = 2,
    vocab: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
) -> Any:
    """A ``transformers.Qwen2ForCausalLM`` of these sizes, its weights drawn after
    ``torch.manual_seed(seed)``."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config)


def token_inputs(model: Any, batch: int, seq: int) -> dict[str, Any]:
    """Keyword arguments for a causal language model: random token ids of shape
    ``(batch, seq)`` from its vocabulary, and no key-value cache."""
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return {"input_ids": ids, "use_cache": False}
