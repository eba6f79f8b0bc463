"""DeepSeek-V3: multi-head latent attention (MLA). The low-rank query and key/value projections
and their norms compute latents every head reads; the up-projections ``q_b_proj`` /
``kv_b_proj`` are per head. ``kv_a_proj_with_mqa``'s last ``qk_rope_head_dim`` outputs are the
rotary key, read by every head directly. Grouped top-k routing (the router ``gate``), fused
experts, a shared expert."""

from fsdp_turbo.core.families.facts import Family, LatentModule
from fsdp_turbo.core.families.registry import register_family


def mla_latents(attention_class: str) -> tuple[LatentModule, ...]:
    """MLA's latent modules, by the names transformers' MLA attentions share."""
    return (LatentModule(attention_class, "q_a_proj"),
            LatentModule(attention_class, "q_a_layernorm"),
            LatentModule(attention_class, "kv_a_proj_with_mqa", shared_tail="qk_rope_head_dim"),
            LatentModule(attention_class, "kv_a_layernorm"))


FAMILY = register_family(Family(
    name="deepseek-v3",
    model_types=("deepseek_v3",),
    latent_modules=mla_latents("DeepseekV3Attention"),
))
