"""GLM-MoE-DSA (GLM-5): DeepSeek-V3.2's sparse attention and MoE under GLM's names (its indexer
rotates interleaved pairs). Layers its ``indexer_types`` call ``shared`` have no indexer and
reuse the previous layer's top-k keys, which each decoder layer passes on."""

from fsdp_turbo.core.families.deepseek_v3 import mla_latents
from fsdp_turbo.core.families.facts import Family
from fsdp_turbo.core.families.registry import register_family

FAMILY = register_family(Family(
    name="glm-moe-dsa",
    model_types=("glm_moe_dsa",),
    latent_modules=mla_latents("GlmMoeDsaAttention"),
    indexers=("GlmMoeDsaIndexer",),
))
