"""MiniMax-M2: softmax attention whose q and k norms act on the flat projection outputs, over
every head's channels at once (weights of ``heads * head_dim`` and ``kv_heads * head_dim``), before
the per-head view: under tensor parallel their statistic is summed over the ranks' heads.
Sigmoid top-k routing with a correction bias on the MoE block; fused experts in every layer,
whose ``intermediate_size`` is one expert's width."""

from fsdp_turbo.core.families.facts import Family, HeadsNorm, SizeNames
from fsdp_turbo.core.families.registry import register_family

FAMILY = register_family(Family(
    name="minimax-m2",
    model_types=("minimax_m2",),
    heads_norms=(HeadsNorm("MiniMaxM2Attention", "q_norm", "q_proj"),
                 HeadsNorm("MiniMaxM2Attention", "k_norm", "k_proj")),
    sizes=SizeNames(moe_intermediate=("intermediate_size",), intermediate=()),
))
