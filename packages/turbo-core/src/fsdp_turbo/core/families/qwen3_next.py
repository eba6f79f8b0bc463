"""Qwen3-Next: Gated DeltaNet linear attention in most layers (``layer_types``
``linear_attention``), gated softmax attention every ``full_attention_interval``; MoE with a
shared expert behind a sigmoid gate."""

import torch
from torch import nn

from fsdp_turbo.core.families.facts import Family
from fsdp_turbo.core.families.linear_forms import GatedDeltaNetForm, Projections
from fsdp_turbo.core.families.registry import register_family


class Qwen3NextGatedDeltaNetForm(GatedDeltaNetForm):
    """q, k, v, z fused per key-head group in ``in_proj_qkvz``, b and a in ``in_proj_ba``
    (the model's own ``fix_query_key_value_ordering`` takes them apart)."""

    form = "Gated DeltaNet (Qwen3-Next)"
    class_names = ("Qwen3NextGatedDeltaNet",)

    @classmethod
    def project(cls, module: nn.Module, hidden_states: torch.Tensor) -> Projections:
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                               module.in_proj_ba(hidden_states))
        return Projections(q, k, v, z, b, a)


FAMILY = register_family(Family(
    name="qwen3-next",
    model_types=("qwen3_next",),
    linear_attention=(Qwen3NextGatedDeltaNetForm,),
))
