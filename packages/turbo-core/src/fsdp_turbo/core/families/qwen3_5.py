"""Qwen3.5 and Qwen3.5-MoE (text): Gated DeltaNet with separate projections every other
layer, softmax attention between; dense, or MoE with a shared expert."""

import torch
from torch import nn

from fsdp_turbo.core.families.facts import Family
from fsdp_turbo.core.families.linear_forms import GatedDeltaNetForm, Projections
from fsdp_turbo.core.families.registry import register_family


class Qwen35GatedDeltaNetForm(GatedDeltaNetForm):
    """``in_proj_qkv`` ([q | k | v] channels), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    form = "Gated DeltaNet (Qwen3.5)"
    class_names = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")

    @classmethod
    def project(cls, module: nn.Module, hidden_states: torch.Tensor) -> Projections:
        batch, seq = hidden_states.shape[:2]
        q, k, v = module.in_proj_qkv(hidden_states).split([module.key_dim, module.key_dim, module.value_dim], -1)
        return Projections(q.unflatten(-1, (-1, module.head_k_dim)), k.unflatten(-1, (-1, module.head_k_dim)),
                           v.unflatten(-1, (-1, module.head_v_dim)),
                           module.in_proj_z(hidden_states).reshape(batch, seq, -1, module.head_v_dim),
                           module.in_proj_b(hidden_states), module.in_proj_a(hidden_states))


FAMILY = register_family(Family(
    name="qwen3.5",
    model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
    linear_attention=(Qwen35GatedDeltaNetForm,),
))
