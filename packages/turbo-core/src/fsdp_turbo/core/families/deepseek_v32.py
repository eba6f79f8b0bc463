"""DeepSeek-V3.2: DeepSeek-V3's MLA and MoE, plus DeepSeek Sparse Attention: in every layer
(``layer_types`` ``indexed_attention``) an indexer scores each query against every earlier
token from the query latent and the hidden states, and the attention reads only its top
``index_topk`` keys. The indexer's forward runs without gradients (nothing trains it in
transformers' code) and takes its keys through ``past_key_values.update_indexer``; its modules
stay in high precision."""

from fsdp_turbo.core.families.deepseek_v3 import mla_latents
from fsdp_turbo.core.families.facts import Family
from fsdp_turbo.core.families.registry import register_family

FAMILY = register_family(Family(
    name="deepseek-v3.2",
    model_types=("deepseek_v32",),
    latent_modules=mla_latents("DeepseekV32Attention"),
    indexers=("DeepseekV32Indexer",),
))
