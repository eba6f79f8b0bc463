"""Gemma 4 (text): sliding-window layers beside global ones (``layer_types``, 5:1 by default),
the global ones with their own head dim and, where keys double as values
(``attention_k_eq_v``), their own key/value head count; per-layer values live in the
config's ``per_layer_config`` (a heterogeneous config, read as Hugging Face's convention
says). Per-head q/k norms over ``head_dim``; the last layers may reuse an earlier layer's
keys and values; per-layer token inputs; in the MoE variant every layer adds routed experts
(the router ``router`` beside them) to a dense MLP."""

from fsdp_turbo.core.families.facts import Family, SizeNames
from fsdp_turbo.core.families.registry import register_family

FAMILY = register_family(Family(
    name="gemma-4",
    model_types=("gemma4_text",),
    sizes=SizeNames(top_k=("top_k_experts",)),
    block_token_inputs=("per_layer_input",),
    before_blocks=("*.embed_tokens_per_layer", "*.per_layer_model_projection", "*.per_layer_projection_norm"),
))
