"""Linear attention (Gated DeltaNet, Kimi Delta Attention) under Ulysses context parallel.

A linear-attention layer carries a state along the sequence (the causal short convolution's
window, the delta rule's matrix state), so its sequence chunk alone is not enough. Under
Ulysses it is run like softmax attention: the per-token projections stay local (each rank its
chunk); one all-to-all takes q, k, v and the gates ``b``, ``a`` from ``[B, S/cp, heads, d]`` to
``[B, S, heads/cp, d]``; the convolution (the rank's heads' channels of its depthwise weight)
and the delta rule (its heads' decay) run unchanged over the whole sequence; one all-to-all
takes the output back before the gated norm and the output projection. Packed documents
(``position_ids`` restarting inside a row) restart the convolution and the delta rule at each
document. A ring cannot do this (the state would have to pass from rank to rank along the
sequence): ``refuse_ring`` stops it when planning.

What differs between models (the projections, where the decay's parameters live, the norm)
is the layer's form, stated by its family in ``fsdp_turbo.core.families`` and found in the
model facts; this module reads every layer only through its form.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.families import LinearAttentionForm, LinearShape
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.distributed.context_parallel.all_to_all import heads_to_sequence, sequence_to_channels
from fsdp_turbo.distributed.context_parallel.context import CPState

# The short convolution's activation, by the name the model's config gives (transformers' ACT2FN names; a
# feature package does not import transformers).
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh}

# The recurrence each form's rule names, by the op registry's (fla's) name.
RULE_OPS = {"gated_delta_rule": "chunk_gated_delta_rule", "kda": "chunk_kda"}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ConfigError("model.config.hidden_act", name, f"use one of {sorted(_ACTIVATIONS)}, or add it to "
                          "context_parallel.linear_attention._ACTIVATIONS",
                          reason="the linear-attention layer's convolution activation is not known under CP")
    return _ACTIVATIONS[name]


# ----- planning -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearAttentionLayer:
    name: str
    form: type[LinearAttentionForm]


def find_linear_attention(facts: ModelFacts) -> tuple[LinearAttentionLayer, ...]:
    """The model facts' linear-attention layers, each with its form. A recurrent mixer no
    form reads is refused: cut to a chunk, it would silently see only that chunk."""
    found = []
    for layer in facts.layers_of("linear"):
        if layer.form is None:
            raise ConfigError("context_parallel_size", ">1", "use context_parallel_size=1 for this model, or state "
                              "its linear-attention form in a family (fsdp_turbo.core.families.register_family)",
                              reason=f"{layer.name} is a recurrent token mixer ({layer.declared}) that no registered "
                                     "linear-attention form reads")
        found.append(LinearAttentionLayer(layer.name, layer.form))
    return tuple(found)


def key_heads_after_split(key_heads: int, value_heads: int, cp: int) -> int:
    """The key heads the all-to-all splits: the model's own when cp divides them, else as
    many as the value heads (each key head repeated to its value heads, as the delta rule
    itself does), which cp must then divide."""
    return key_heads if key_heads % cp == 0 else value_heads


def check_linear_heads(model: nn.Module, layers: Sequence[LinearAttentionLayer], cp: int) -> None:
    """Ulysses splits each linear-attention layer's value heads over cp (and its key heads,
    repeated to the value heads where cp does not divide them)."""
    for layer in layers:
        shape = layer.form.shape(model.get_submodule(layer.name))
        if shape.value_heads % cp:
            raise ConfigError("context_parallel_size", cp, f"use a context_parallel_size that divides the "
                              f"{shape.value_heads} linear-attention value heads",
                              reason=f"Ulysses splits the linear-attention heads of {layer.name} over the CP ranks "
                                     f"({shape.key_heads} key heads, {shape.value_heads} value heads)")


def refuse_ring(layers: Sequence[LinearAttentionLayer], mode: str) -> None:
    if layers and mode != "ulysses":
        raise ConfigError("cp_plan.mode", mode, "use cp_plan.mode: ulysses for this model (Ulysses gives each rank "
                          "the whole sequence for its share of the linear-attention heads)",
                          reason=f"{layers[0].name} (a {layers[0].form.form}; {len(layers)} linear-attention "
                                 "layers in all) carries a state along the sequence (the delta rule and its short "
                                 "convolution), which a ring of sequence chunks cannot pass from rank to rank")


# ----- the Ulysses forward ------------------------------------------------------------------
def _head_slice(heads: int, cp: int, rank: int) -> slice:
    share = heads // cp
    return slice(rank * share, (rank + 1) * share)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, s, h, d]`` -> ``[B, s, heads, d]``, each head repeated in place (``[k0, k0, k1, k1]``)."""
    return x if x.shape[2] == heads else x.repeat_interleave(heads // x.shape[2], dim=2)


def _my_channels(shape: LinearShape, channels: torch.Tensor, key_heads: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's rows of ``channels [q | k | v, ...]`` (the depthwise conv's weight or bias):
    its q, k heads (repeated to ``key_heads``) and its v heads."""
    key_dim, value_dim = shape.key_heads * shape.head_k_dim, shape.value_heads * shape.head_v_dim
    q, k, v = channels.split([key_dim, key_dim, value_dim])
    keys = _head_slice(key_heads, cp, rank)
    q, k = (w.unflatten(0, (shape.key_heads, -1)).repeat_interleave(key_heads // shape.key_heads, 0)[keys]
            for w in (q, k))
    v = v.unflatten(0, (shape.value_heads, -1))[_head_slice(shape.value_heads, cp, rank)]
    return torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                documents: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution of ``x [B, S, C]`` (``weight [C, kernel]``), as the model's
    ``causal_conv1d_fn`` before its activation; with ``documents [B, S]`` each tap reads only
    tokens of the same document, so the window restarts at every document."""
    seq, kernel = x.shape[1], weight.shape[-1]
    if documents is None:
        out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=kernel - 1, groups=x.shape[-1])
        return out[..., :seq].transpose(1, 2)
    out = x * weight[:, -1]
    for back in range(1, kernel):  # tap kernel-1-back reads the token `back` places earlier
        earlier = F.pad(x, (0, 0, back, 0))[:, :seq]
        same = (F.pad(documents, (back, 0), value=-1)[:, :seq] == documents).unsqueeze(-1)
        out = out + earlier * same * weight[:, -1 - back]
    return out if bias is None else out + bias


def document_bounds(documents: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` of ``[B, S]`` rows of packed documents flattened into one row: a
    sequence starts at every row and wherever the document index changes."""
    batch, seq = documents.shape
    starts = F.pad(documents.diff(dim=1) != 0, (1, 0), value=True).flatten()
    bounds = torch.nonzero(starts).flatten()
    return torch.cat([bounds, bounds.new_tensor([batch * seq])])


def _delta_rule(rule: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                documents: torch.Tensor | None) -> torch.Tensor:
    import fsdp_turbo.ops.fla  # noqa: F401 - registers the ops
    from fsdp_turbo.ops.registry import get_op

    op = get_op(RULE_OPS[rule], q.device.type)
    if documents is None:
        return op(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    batch = q.shape[0]
    flat = [x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g, beta)]
    out = op(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=document_bounds(documents))[0]
    return out.squeeze(0).unflatten(0, (batch, -1))


def _refuse_a_cache(module: nn.Module, cache_params: Any) -> None:
    # Training builds an empty cache that nothing reads: it stays empty here (the input hook
    # refuses a cache passed in). One that holds this layer's state continues a sequence.
    if cache_params is not None and cache_params.get_recurrent_state(module.layer_idx) is not None:
        raise ConfigError("use_cache", True, "call the model with use_cache=False (and no past_key_values) under "
                          "context parallel", reason="a linear-attention cache continues one whole sequence, and "
                                                     "each CP rank holds a chunk of it")


def ulysses_linear_attention(module: nn.Module, form: type[LinearAttentionForm], state: CPState,
                             hidden_states: torch.Tensor, cache_params: Any = None,
                             attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The layer's forward on this rank's chunk ``[B, S/cp, hidden]``, computed over the whole
    sequence for its share of the heads (``functools.partial`` it to the module's forward)."""
    context = state.current
    if context is None:
        raise RuntimeError("context-parallel linear attention ran outside a context-parallel forward")
    context.linear_calls += 1
    _refuse_a_cache(module, cache_params)
    cp, group, rank = state.size, state.group, state.rank
    seq = hidden_states.shape[1]
    if context.padding_mask is not None:  # as the model zeroes padding (its attention_mask is None under CP)
        mine = context.padding_mask[:, rank * seq:(rank + 1) * seq].to(hidden_states.device)
        hidden_states = hidden_states * mine.unsqueeze(-1).to(hidden_states.dtype)
    p = form.project(module, hidden_states)
    shape = form.shape(module)
    key_heads = key_heads_after_split(shape.key_heads, shape.value_heads, cp)
    q, k = _repeat_heads(p.q, key_heads), _repeat_heads(p.k, key_heads)
    # One all-to-all: per destination rank, its q, k, v heads' channels and its heads' b, a
    # (a: one value per head, or one per key channel of each head).
    parts = [t.unflatten(2, (cp, -1)).flatten(3) for t in (q, k, p.v, p.b, p.a)]
    whole = sequence_to_channels(torch.cat(parts, dim=-1), group, cp)  # [B, S, channels of my heads]
    my_values = shape.value_heads // cp
    conv_channels = (2 * key_heads * shape.head_k_dim + shape.value_heads * shape.head_v_dim) // cp
    mixed, b, a = whole.split([conv_channels, my_values, parts[-1].shape[-1]], dim=-1)
    if p.a.dim() == 4:
        a = a.unflatten(-1, (my_values, -1))
    documents = None if context.documents is None else context.documents.to(whole.device)
    weight, bias, activation = form.conv(module)
    mixed = causal_conv(mixed, _my_channels(shape, weight, key_heads, cp, rank),
                        None if bias is None else _my_channels(shape, bias, key_heads, cp, rank), documents)
    mixed = _activation(activation)(mixed)
    key_channels = key_heads * shape.head_k_dim // cp
    q, k, v = mixed.split([key_channels, key_channels, conv_channels - 2 * key_channels], dim=-1)
    q, k = q.unflatten(-1, (-1, shape.head_k_dim)), k.unflatten(-1, (-1, shape.head_k_dim))
    v = v.unflatten(-1, (-1, shape.head_v_dim))
    g = form.decay(module, a, _head_slice(shape.value_heads, cp, rank))
    out = _delta_rule(form.rule, q, k, v, g, b.sigmoid(), documents)  # [B, S, value heads / cp, dv]
    out = heads_to_sequence(out, group, cp)  # [B, S/cp, value heads, dv]
    return form.output(module, out, p.z)


def install_linear_attention(model: nn.Module, layers: Sequence[LinearAttentionLayer], state: CPState) -> None:
    """Replace each layer's forward (the instance's: other models keep theirs)."""
    for layer in layers:
        module = model.get_submodule(layer.name)
        module.forward = functools.partial(ulysses_linear_attention, module, layer.form, state)
