"""Tiny Hugging Face models built from a config with random init; nothing is downloaded.

``transformers`` is a test dependency only, so it is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_turbo.core.testing.parity import seed_everything

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
}


TINY_MOE_DEFAULTS: dict[str, Any] = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}


def tiny_hf_causal_lm(kind: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      **overrides: Any) -> nn.Module:
    """A tiny ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` (8 experts,
    top-2); the same seed gives the same weights."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, TINY_MOE_DEFAULTS),
    }
    if kind not in classes:
        raise ValueError(f"unknown tiny model {kind!r}; use one of {sorted(classes)}")
    config_cls, model_cls, extra = classes[kind]
    config = config_cls(**{**TINY_DEFAULTS, **extra, **overrides})
    seed_everything(seed)
    return model_cls(config).to(dtype)
