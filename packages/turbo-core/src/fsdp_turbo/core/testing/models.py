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
TINY_MIXTRAL_DEFAULTS: dict[str, Any] = {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2}
TINY_QWEN2_MOE_DEFAULTS: dict[str, Any] = {**TINY_MOE_DEFAULTS, "shared_expert_intermediate_size": 64}
# DeepSeek-V3: MLA attention, grouped top-k routing, one dense layer first, one shared expert.
TINY_DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8,
}
# gpt-oss: attention sinks, sliding-window layers (every other one), experts with biases and a
# clamped SwiGLU. layer_types is derived by the config from num_hidden_layers.
# Plain rotary: the default YaRN scaling expects a 4096-token original context.
TINY_GPT_OSS_DEFAULTS: dict[str, Any] = {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                                         "sliding_window": 8,
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}
# Qwen3-Next: Gated DeltaNet linear attention in most layers (full attention every
# full_attention_interval), MoE with a shared expert.
TINY_QWEN3_NEXT_DEFAULTS: dict[str, Any] = {
    **TINY_MOE_DEFAULTS, "shared_expert_intermediate_size": 32, "full_attention_interval": 2,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}

# Qwen3.5 (text): Gated DeltaNet with separate q/k/v, z, b, a projections, every other layer
# (full_attention_interval 2); dense, or MoE with a shared expert in every layer.
TINY_QWEN3_5_DEFAULTS: dict[str, Any] = {
    "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
TINY_QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    **TINY_QWEN3_5_DEFAULTS, **TINY_MOE_DEFAULTS, "shared_expert_intermediate_size": 32}


def tiny_hf_causal_lm(kind: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device | None = None, **overrides: Any) -> nn.Module:
    """A tiny ``LlamaForCausalLM``, ``Qwen3ForCausalLM``, or MoE model with 8 experts, top-2:
    ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
    ``DeepseekV3ForCausalLM``, ``GptOssForCausalLM``, ``Qwen3NextForCausalLM`` or
    ``Qwen3_5MoeForCausalLM``; or the dense ``Qwen3_5ForCausalLM``; the same seed
    gives the same weights. ``device="meta"``
    builds it with no storage (for ``fsdp_turbo.checkpoint``)."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, TINY_MOE_DEFAULTS),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, TINY_MIXTRAL_DEFAULTS),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, TINY_QWEN2_MOE_DEFAULTS),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, TINY_DEEPSEEK_V3_DEFAULTS),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, TINY_GPT_OSS_DEFAULTS),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, TINY_QWEN3_NEXT_DEFAULTS),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, TINY_QWEN3_5_DEFAULTS),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM,
                        TINY_QWEN3_5_MOE_DEFAULTS),
    }
    if kind not in classes:
        raise ValueError(f"unknown tiny model {kind!r}; use one of {sorted(classes)}")
    config_cls, model_cls, extra = classes[kind]
    config = config_cls(**{**TINY_DEFAULTS, **extra, **overrides})
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return model_cls(config).to(dtype)
    seed_everything(seed)
    return model_cls(config).to(dtype)


# ----- experts as a ModuleList (custom and older models) ------------------------------------
class SwiGLUExpert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ExpertMLPList(nn.ModuleList):
    """A custom model's experts: a ModuleList of MLPs with the HF experts' forward."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for index, expert in enumerate(self):
            token, slot = torch.where(top_k_index == index)
            out = out.index_add(0, token, expert(hidden_states[token]) * top_k_weights[token, slot, None])
        return out


def to_expert_lists(model: nn.Module) -> nn.Module:
    """Replace each fused experts module by an ``ExpertMLPList`` with the same weights (on the
    meta device: with the same shapes)."""
    for name, module in list(model.named_modules()):
        if name.endswith("mlp.experts"):
            num, two_inter, hidden = module.gate_up_proj.shape
            with torch.device(module.gate_up_proj.device):
                experts = ExpertMLPList([SwiGLUExpert(hidden, two_inter // 2) for _ in range(num)])
            with torch.no_grad():
                for index, expert in enumerate(experts if not module.gate_up_proj.is_meta else ()):
                    gate, up = module.gate_up_proj[index].chunk(2)
                    expert.gate_proj.weight.copy_(gate)
                    expert.up_proj.weight.copy_(up)
                    expert.down_proj.weight.copy_(module.down_proj[index])
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, experts)
    return model
