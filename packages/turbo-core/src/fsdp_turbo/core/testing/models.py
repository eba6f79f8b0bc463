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


# GLM-4-MoE: per-head q/k norms, partial rotary, grouped sigmoid routing, one dense layer first.
TINY_GLM4_MOE_DEFAULTS: dict[str, Any] = {
    "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "use_qk_norm": True,
}
# MiniMax-M2: q/k norms over every head's channels; intermediate_size is one expert's width.
TINY_MINIMAX_M2_DEFAULTS: dict[str, Any] = {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                                            "rotary_dim": 8, "bos_token_id": None, "eos_token_id": None}
# Gemma 4 (text), one tiny model with every part: sliding (window 4) and global layers, the global
# ones with head dim 32 and keys doubling as values over 2 heads of their own; the last two layers
# reuse the first two's keys and values; per-layer token inputs; MoE beside the dense MLP; final
# logit soft-capping. Four experts: with eight, its softmax router ties often enough after a step or two that
# a last-bit difference (reduction order) flips a choice and the losses part by 1e-4.
TINY_GEMMA4_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 4,
    "global_head_dim": 32, "attention_k_eq_v": True, "num_global_key_value_heads": 2, "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256, "enable_moe_block": True,
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32, "final_logit_softcapping": 30.0,
    "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
}
# Llama 4 (text): chunked attention (chunk 6 of 16 tokens: under CP=2 and CP=4 its boundaries fall
# inside a rank's part of the sequence, so a mask cut per rank would differ) in layers 0-2, a NoPE full layer 3
# whose queries get the temperature (floor_scale 4: it varies over 16 tokens); MoE in layers 1, 3.
TINY_LLAMA4_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 4, "intermediate_size": 32, "intermediate_size_mlp": 128, "num_local_experts": 8,
    "num_experts_per_tok": 2, "interleave_moe_layer_step": 2, "no_rope_layer_interval": 4,
    "attention_chunk_size": 6, "floor_scale": 4, "attn_scale": 0.1, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2,
}
# Kimi Linear: KDA linear attention in layer 0, MLA (no rotary; value heads 16 wide, query/key
# heads 24) in layer 1; a dense first layer, then MoE with a shared expert.
TINY_KIMI_LINEAR_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 2, "num_key_value_heads": 4, "moe_intermediate_size": 32,
    "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4, "num_local_experts": 8,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2,
}
# DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA): MLA whose keys an indexer picks, 8 of
# each query's (16 tokens), value heads 12 wide beside 16-wide query/key heads. GLM-MoE-DSA's
# second layer reuses the first's picks (indexer_types "shared").
TINY_DSA_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16,
    "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12, "index_n_heads": 2,
    "index_head_dim": 16, "index_topk": 8,
}

# DeepSeek-V4: three layers, one of each attention kind (a window of 8; compressed sparse entries of
# every 4 tokens, 2 of them picked per query; heavily compressed entries of every 8), all sharing one
# key/value head and one sink logit per head; two residual streams (hyper-connections); a
# hash-routed MoE layer, then top-k routed ones; a grouped output projection.
TINY_DEEPSEEK_V4_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 3, "head_dim": 32, "partial_rotary_factor": 0.25, "q_lora_rank": 32, "o_groups": 2,
    "o_lora_rank": 16, "intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, "sliding_window": 8,
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 2, "hc_mult": 2, "hc_sinkhorn_iters": 3,
    "use_cache": False,
}


def tiny_hf_causal_lm(kind: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device: str | torch.device | None = None, **overrides: Any) -> nn.Module:
    """A tiny ``LlamaForCausalLM``, ``Qwen3ForCausalLM``, or MoE model with 8 experts, top-2:
    ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
    ``DeepseekV3ForCausalLM``, ``GptOssForCausalLM``, ``Qwen3NextForCausalLM`` or
    ``Qwen3_5MoeForCausalLM``; or the dense ``Qwen3_5ForCausalLM``; the same seed
    gives the same weights. ``device="meta"``
    builds it with no storage (for ``fsdp_turbo.checkpoint``)."""
    import transformers

    # class names, not classes: each attribute of transformers' lazy module imports its model
    # family's files, so naming them all would import 18 families in every new rank process
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", TINY_MOE_DEFAULTS),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", TINY_MIXTRAL_DEFAULTS),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", TINY_QWEN2_MOE_DEFAULTS),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", TINY_DEEPSEEK_V3_DEFAULTS),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", TINY_GPT_OSS_DEFAULTS),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", TINY_QWEN3_NEXT_DEFAULTS),
        "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", TINY_QWEN3_5_DEFAULTS),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", TINY_QWEN3_5_MOE_DEFAULTS),
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", TINY_GLM4_MOE_DEFAULTS),
        "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", TINY_MINIMAX_M2_DEFAULTS),
        "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", TINY_GEMMA4_DEFAULTS),
        "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", TINY_LLAMA4_DEFAULTS),
        "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", TINY_KIMI_LINEAR_DEFAULTS),
        "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", TINY_DSA_DEFAULTS),
        "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", TINY_DEEPSEEK_V4_DEFAULTS),
        "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                        {**TINY_DSA_DEFAULTS, "indexer_types": ["full", "shared"]}),
    }
    if kind not in classes:
        raise ValueError(f"unknown tiny model {kind!r}; use one of {sorted(classes)}")
    config_name, model_name, extra = classes[kind]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    config = config_cls(**{**TINY_DEFAULTS, **extra, **overrides})
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return model_cls(config).to(dtype)
    seed_everything(seed)
    model = model_cls(config).to(dtype)
    _fill_hash_routes(model, seed)
    return model


def _fill_hash_routes(model: nn.Module, seed: int) -> None:
    """Give hash routers (DeepSeek-V4's ``tid2eid``, all zeros until a checkpoint fills it)
    distinct experts per token: with the zeros every token would pick expert 0 ``top_k`` times,
    its weights would be constant and the gate would get no gradient worth comparing."""
    generator = torch.Generator().manual_seed(seed + 7919)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor):
            vocab, top_k = table.shape
            picks = torch.rand(vocab, module.num_experts, generator=generator).argsort(dim=-1)[:, :top_k]
            table.copy_(picks)


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
