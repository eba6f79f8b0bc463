"""Training FLOPs per token, from the model's shapes and config: the numerator of TFLOP/s and MFU.

    flops per token = 6 x (matmul weights one token passes through)   [the weights' GEMMs]
                    + 12 x L x (heads x head_dim) x seq_len           [attention scores and values]

A weight of a GEMM costs 2 FLOPs per token forward (a multiply and an add) and 4 backward (the
gradients of its input and of itself), hence 6. Only the weights a token *passes through*
count: of a mixture of experts, ``top_k / num_experts`` of the routed experts (each token
visits ``top_k`` of them), but the shared experts and the router whole. The input embedding is
a lookup, not a GEMM, so it is left out; the output head is a GEMM and counts, once, even when
it shares its weight with the embedding. Norm weights and biases are elementwise, not GEMMs.

The attention term is the PaLM appendix's (Chowdhery et al. 2022, B): per layer and token,
``Q K^T`` and ``softmax(.) V`` are each ``2 x heads x head_dim x seq_len`` FLOPs forward, three
times that with the backward. It counts the whole ``seq_len x seq_len`` matrix, not the causal
half: that is what eager attention computes (and ``FlopCounterMode`` counts), and the
convention published MFU figures use; a causal flash kernel skips about half of this term, a
sliding-window one more. Recompute's extra forward is not counted: MFU counts the model's
FLOPs, not the hardware's.

A linear-attention layer (Gated DeltaNet, Kimi Delta Attention: ``AttentionKind.LINEAR`` in the
model facts) has no ``seq_len x seq_len`` matrix: its projections and short convolution count
as weights above, and its recurrence carries one state ``[head_k_dim, head_v_dim]`` per value
head. Per token and value head, the delta rule reads the state with the key (``S^T k``), writes
a rank-one correction into it (``k (beta (v - S^T k))^T``) and reads it with the query (``S^T
q``): three ``d_k x d_v`` multiply-adds, ``6 d_k d_v`` FLOPs forward, ``18 d_k d_v`` with the
backward; the decay and the gates are elementwise. Other layers keep the PaLM term, each with
its own head dims where it has them (Gemma 4's global layers).

The model is read as built on the meta device, before FSDPTurbo wraps it: shapes only. Its
sizes (layers, heads, head dims, top-k) and each layer's kind are the model facts'
(``ModelFacts.sizes``, ``ModelFacts.attention_layers``).
"""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.families import AttentionKind
from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.model_inspect import fused_experts_form, has_router_forward

_log = get_logger("fsdp_turbo.cli.flops")

# Forward 2 FLOPs per weight and token (multiply, add); backward 4 (input and weight gradients).
GEMM_TRAINING_FLOPS = 6


# The delta rule's three d_k x d_v multiply-adds per token and value head, x3 with the backward.
DELTA_RULE_TRAINING_FLOPS = 3 * 2 * 3


def flops_per_token(model: nn.Module, facts: ModelFacts, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token of ``model`` on sequences of ``seq_len``."""
    return GEMM_TRAINING_FLOPS * active_matmul_weights(model, facts) + mixing_flops_per_token(model, facts, seq_len)


def mixing_flops_per_token(model: nn.Module, facts: ModelFacts, seq_len: int) -> float:
    """The token mixers' own FLOPs (beyond their weights): each softmax-like layer's scores and
    values over ``seq_len`` keys, each linear-attention layer's recurrence. Without per-layer
    facts, every layer as softmax attention of the model's sizes."""
    layers, heads, qk_dim, v_dim = attention_shape(facts)
    if not facts.attention_layers:
        return attention_flops_per_token(layers, heads, qk_dim, v_dim, seq_len)
    total = 0.0
    for layer in facts.attention_layers:
        if layer.kind == AttentionKind.LINEAR and layer.form is not None:
            total += recurrence_flops_per_token(model.get_submodule(layer.name), layer.form)
            continue
        if layer.kind == AttentionKind.LINEAR:  # only the throughput figures depend on it: say so
            warn_once(_log, f"FLOPs per token count {layer.name} as softmax attention (an upper bound): no "
                            "registered linear-attention form gives its state's shape")
        # a layer with its own head dim has keys and values of that width (Gemma 4's global layers)
        total += attention_flops_per_token(1, heads, layer.head_dim or qk_dim, layer.head_dim or v_dim, seq_len)
    return total


def recurrence_flops_per_token(module: nn.Module, form: type) -> float:
    """A linear-attention layer's recurrence, per token: ``18 x value heads x d_k x d_v``."""
    shape = form.shape(module)
    return DELTA_RULE_TRAINING_FLOPS * shape.value_heads * shape.head_k_dim * shape.head_v_dim


def attention_flops_per_token(layers: int, heads: int, qk_dim: int, v_dim: int, seq_len: int) -> float:
    """Scores ``Q K^T`` (``qk_dim`` deep) and values (``v_dim`` wide) over all ``seq_len`` keys,
    2 FLOPs a multiply-add, x3 for the backward; with ``qk_dim == v_dim`` PaLM's ``12 L H Q T``."""
    forward = 2 * heads * (qk_dim + v_dim) * seq_len
    return 3 * forward * layers


def attention_shape(facts: ModelFacts) -> tuple[int, int, int, int]:
    """(layers, query heads, query/key head dim, value head dim) of the model facts' sizes; zeros
    where the model does not say (then the attention term is 0, as for a model with no
    attention). DeepSeek's MLA has its own query/key (nope + rope) and value head dims."""
    sizes = facts.sizes
    return sizes.layers, sizes.heads or 0, sizes.head_dim, sizes.v_head_dim


def active_matmul_weights(model: nn.Module, facts: ModelFacts) -> float:
    """The GEMM weights one token passes through (fractional: routed experts count by the share
    of them a token visits)."""
    return _active_weights(model, facts)


def _active_weights(module: nn.Module, facts: ModelFacts) -> float:
    if has_router_forward(module):  # forward(hidden_states, top_k_index, top_k_weights): routed experts
        return expert_weights(module) * routed_fraction(module, facts)
    return own_matmul_weights(module) + sum(_active_weights(child, facts) for child in module.children())


def own_matmul_weights(module: nn.Module) -> int:
    """The module's own weights of two or more dims (a Linear's, a router's), not its
    children's. An embedding's table is a lookup; 1-D weights (norms, biases) are elementwise.
    A weight shared by two modules (a tied head) counts in each module that multiplies by it."""
    if isinstance(module, nn.Embedding):
        return 0
    return sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)


def expert_weights(experts: nn.Module) -> int:
    """All experts' GEMM weights: a fused container's ``gate_up_proj`` and ``down_proj`` (not
    their ``[E, out]`` biases), or the matmul weights of a list of expert MLPs."""
    if fused_experts_form(experts) is not None:
        return experts.gate_up_proj.numel() + experts.down_proj.numel()
    return sum(own_matmul_weights(m) for m in experts.modules())


def routed_fraction(experts: nn.Module, facts: ModelFacts) -> float:
    """``top_k / num_experts``: the share of the routed experts one token goes through. Expert
    counts come from the container's shape where it has one (EP-free here: the model is whole)."""
    form = fused_experts_form(experts)
    if form is not None:
        total = form.num_experts
    elif isinstance(experts, nn.ModuleList | nn.ModuleDict):
        total = len(experts)
    else:
        total = facts.sizes.experts
    top_k = facts.sizes.top_k
    if not top_k or not total:
        # Only the throughput figures depend on this: say so, and count every expert (an upper bound).
        warn_once(_log, f"FLOPs per token count every expert as active: the model facts have no top-k "
                        f"(experts a token visits) or {type(experts).__name__} no expert count")
        return 1.0
    return min(int(top_k) / int(total), 1.0)
