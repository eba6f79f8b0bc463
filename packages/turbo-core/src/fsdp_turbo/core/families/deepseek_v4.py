"""DeepSeek-V4: every layer attends within a sliding window over the tokens, with one key/value
head (the same tensor as keys and values) and one sink logit per head; its compressed layers
(``layer_types`` ``compressed_sparse_attention``, ``heavily_compressed_attention``) also read
entries a compressor makes from the whole sequence (softmax-gated sums over blocks of ``rate``
tokens; the sparse kind keeps each query's top-k of them, picked by an indexer that gets no
gradient). Hyper-connections carry ``hc_mult`` residual streams between layers, which a head of
its own folds into one after the last. Its MoE routes by a hash of the token in its first
layers, by top-k elsewhere; its output projection is grouped (a Linear subclass computing one
GEMM per group). Only its eager attention runs (transformers refuses the others)."""

from typing import Any

from fsdp_turbo.core.families.facts import AttentionKind, Family, HeadParameter, LayerKind
from fsdp_turbo.core.families.registry import register_family


def layer_kinds(config: Any, layers: int) -> tuple[LayerKind, ...]:
    """A window in every layer; the compressed ones read the compressor's entries besides."""
    window = getattr(config, "sliding_window", None)
    kinds = []
    for declared in list(config.layer_types)[:layers]:
        kind = AttentionKind.SLIDING if declared == "sliding_attention" else AttentionKind.COMPRESSED
        kinds.append(LayerKind(kind, window=window, declared=declared))
    return tuple(kinds)


FAMILY = register_family(Family(
    name="deepseek-v4",
    model_types=("deepseek_v4",),
    layer_kinds=layer_kinds,
    head_parameters=(HeadParameter("DeepseekV4Attention", "sinks", 0, "attention sinks"),),
    indexers=("DeepseekV4Indexer",),
    compressors=("DeepseekV4HCACompressor", "DeepseekV4CSACompressor"),
    after_blocks=("*.hc_head",),
    block_token_inputs=("input_ids",),  # the hash router looks each token's experts up by its id
    sizes_of=lambda config: {"kv_heads": 1},  # one key/value head, whatever num_key_value_heads says
))
