"""Model families: one file each, stating what a family is (see ``facts.py``).

Every feature reads these facts through ``ModelFacts`` only, so adding a family is one file
here (plus its tests). A model the library does not know is described in the config's
``model_facts`` section, or by registering a :class:`Family` of its own::

    from fsdp_turbo.core.families import Family, HeadParameter, register_family

    register_family(Family(name="mine", head_parameters=(HeadParameter("MyAttention", "sinks"),)))
"""

# The built-in families register themselves when imported.
from fsdp_turbo.core.families import (  # noqa: F401 - the built-in families register themselves
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    gemma4,
    glm4_moe,
    glm_moe_dsa,
    gpt_oss,
    kimi_linear,
    llama4,
    minimax_m2,
    qwen3_5,
    qwen3_next,
)
from fsdp_turbo.core.families.facts import (
    AttentionKind,
    Family,
    HeadParameter,
    HeadsNorm,
    LatentModule,
    LayerKind,
    MemberPatch,
    SizeNames,
)
from fsdp_turbo.core.families.linear_forms import (
    LINEAR_ATTENTION_FORMS,
    GatedDeltaNetForm,
    LinearAttentionForm,
    LinearShape,
    Projections,
    recognise_linear_attention,
)
from fsdp_turbo.core.families.registry import families, family_for, register_family, unregister_family

__all__ = [
    "LINEAR_ATTENTION_FORMS",
    "AttentionKind",
    "Family",
    "GatedDeltaNetForm",
    "HeadParameter",
    "HeadsNorm",
    "LatentModule",
    "LayerKind",
    "LinearAttentionForm",
    "LinearShape",
    "MemberPatch",
    "Projections",
    "SizeNames",
    "families",
    "family_for",
    "recognise_linear_attention",
    "register_family",
    "unregister_family",
]
