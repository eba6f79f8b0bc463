"""GLM-4-MoE (GLM-4.5 / 4.6): softmax attention with partial rotary and, optionally, per-head
q/k norms over ``head_dim`` (which split with the heads like Qwen3's); grouped sigmoid routing
(the router ``gate``, a weight of its own, not a Linear), fused experts, a shared expert and
``first_k_dense_replace`` dense layers. Everything it has follows HF's conventions."""

from fsdp_turbo.core.families.facts import Family, SizeNames
from fsdp_turbo.core.families.registry import register_family

FAMILY = register_family(Family(
    name="glm-4-moe",
    model_types=("glm4_moe",),
    sizes=SizeNames(experts=("n_routed_experts",)),
))
