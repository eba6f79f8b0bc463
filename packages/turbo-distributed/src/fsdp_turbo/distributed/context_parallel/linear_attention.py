"""Linear attention (Gated DeltaNet) under Ulysses context parallel, and the registry of the
linear-attention forms it recognises.

A linear-attention layer carries a state along the sequence (the causal short convolution's
window, the delta rule's matrix state), so its sequence chunk alone is not enough. Under
Ulysses it is run like softmax attention: the per-token projections stay local (each rank its
chunk); one all-to-all takes q, k, v and the gates ``b``, ``a`` from ``[B, S/cp, heads, d]`` to
``[B, S, heads/cp, d]``; the convolution (the rank's heads' channels of its depthwise weight)
and the delta rule (its heads' ``A_log`` / ``dt_bias``) run unchanged over the whole sequence;
one all-to-all takes the output back before the gated norm and the output projection. Packed
documents (``position_ids`` restarting inside a row) restart the convolution and the delta
rule at each document. A ring cannot do this (the state would have to pass from rank to rank
along the sequence): ``refuse_ring`` stops it when planning.

A form is a class with a ``form`` description, ``detect(module) -> bool`` and
``project(module, hidden_states) -> Projections`` (the layer's per-token projections, in
heads); the rest of the layer (convolution, gates, delta rule, gated norm, output projection)
is the Gated DeltaNet's and shared. Newest first: a form registered later may take over a
module a built-in one also matches.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.distributed.context_parallel.all_to_all import heads_to_sequence, sequence_to_channels
from fsdp_turbo.distributed.context_parallel.context import CPState

# The short convolution's activation, by the name the model's config gives (transformers' ACT2FN names; a
# feature package does not import transformers).
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh}


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ConfigError("model.config.hidden_act", name, f"use one of {sorted(_ACTIVATIONS)}, or add it to "
                          "context_parallel.linear_attention._ACTIVATIONS",
                          reason="the linear-attention layer's convolution activation is not known under CP")
    return _ACTIVATIONS[name]


class Projections(NamedTuple):
    """One chunk's per-token projections: q, k ``[B, s, key_heads, dk]``; v, z ``[B, s,
    value_heads, dv]``; b, a ``[B, s, value_heads]`` (before sigmoid / softplus)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    z: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor


class LinearAttentionForm(Protocol):
    form: str  # a description, named in plans and errors

    @classmethod
    def detect(cls, module: nn.Module) -> bool: ...

    @classmethod
    def project(cls, module: nn.Module, hidden_states: torch.Tensor) -> Projections: ...


_FORMS: list[type[LinearAttentionForm]] = []


def add_linear_attention_form(cls: type[LinearAttentionForm]) -> None:
    """Put ``cls`` first among the forms tried (moving it there if it was registered)."""
    remove_linear_attention_form(cls)
    _FORMS.insert(0, cls)


def remove_linear_attention_form(cls: type[LinearAttentionForm]) -> None:
    """Forget ``cls`` (a no-op if it is not registered)."""
    if cls in _FORMS:
        _FORMS.remove(cls)


def registered_linear_attention_forms() -> Sequence[type[LinearAttentionForm]]:
    """The registered forms, in the order they are tried."""
    return tuple(_FORMS)


def recognise_linear_attention(module: nn.Module) -> type[LinearAttentionForm] | None:
    """The first form that recognises ``module``, else ``None``."""
    return next((form for form in _FORMS if form.detect(module)), None)


def _class_names(module: nn.Module) -> set[str]:
    # By name, so transformers is not imported here; subclasses of a known class count.
    return {klass.__name__ for klass in type(module).__mro__}


class _GatedDeltaNet:
    """What every Gated DeltaNet shares: the attributes read by the Ulysses forward."""

    form = "Gated DeltaNet"
    class_names: tuple[str, ...] = ()

    @classmethod
    def detect(cls, module: nn.Module) -> bool:
        return bool(_class_names(module) & set(cls.class_names))


class Qwen3NextGatedDeltaNetForm(_GatedDeltaNet):
    """transformers' ``Qwen3NextGatedDeltaNet``: q, k, v, z fused per key-head group in
    ``in_proj_qkvz``, b and a in ``in_proj_ba`` (the model's own ``fix_query_key_value_ordering``)."""

    form = "Gated DeltaNet (Qwen3-Next)"
    class_names = ("Qwen3NextGatedDeltaNet",)

    @classmethod
    def project(cls, module: nn.Module, hidden_states: torch.Tensor) -> Projections:
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                               module.in_proj_ba(hidden_states))
        return Projections(q, k, v, z, b, a)


class Qwen35GatedDeltaNetForm(_GatedDeltaNet):
    """transformers' ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet``: ``in_proj_qkv``
    ([q | k | v] channels), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""

    form = "Gated DeltaNet (Qwen3.5)"
    class_names = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")

    @classmethod
    def project(cls, module: nn.Module, hidden_states: torch.Tensor) -> Projections:
        batch, seq = hidden_states.shape[:2]
        q, k, v = module.in_proj_qkv(hidden_states).split([module.key_dim, module.key_dim, module.value_dim], -1)
        return Projections(q.unflatten(-1, (-1, module.head_k_dim)), k.unflatten(-1, (-1, module.head_k_dim)),
                           v.unflatten(-1, (-1, module.head_v_dim)),
                           module.in_proj_z(hidden_states).reshape(batch, seq, -1, module.head_v_dim),
                           module.in_proj_b(hidden_states), module.in_proj_a(hidden_states))


add_linear_attention_form(Qwen3NextGatedDeltaNetForm)
add_linear_attention_form(Qwen35GatedDeltaNetForm)


# ----- planning -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearAttentionLayer:
    name: str
    form: type[LinearAttentionForm]


def find_linear_attention(model: nn.Module) -> tuple[LinearAttentionLayer, ...]:
    """The model's linear-attention layers, each with its form. A recurrent sequence mixer no
    form recognises (an ``A_log`` parameter, as Mamba and DeltaNet layers have) is refused:
    cut to a chunk, it would silently see only that chunk."""
    found = []
    for name, module in model.named_modules():
        form = recognise_linear_attention(module)
        if form is not None:
            found.append(LinearAttentionLayer(name, form))
        elif isinstance(getattr(module, "A_log", None), nn.Parameter):
            known = sorted({c for f in _FORMS for c in getattr(f, "class_names", ())})
            raise ConfigError("context_parallel_size", ">1", "use context_parallel_size=1 for this model, or register "
                              "a linear-attention form for its layer (add_linear_attention_form)",
                              reason=f"{name} ({type(module).__name__}) looks like a recurrent sequence mixer, and "
                                     f"context parallel knows only {known}")
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
        module = model.get_submodule(layer.name)
        if module.num_v_heads % cp:
            raise ConfigError("context_parallel_size", cp, f"use a context_parallel_size that divides "
                              f"linear_num_value_heads={module.num_v_heads}",
                              reason=f"Ulysses splits the linear-attention heads of {layer.name} over the CP ranks "
                                     f"({module.num_k_heads} key heads, {module.num_v_heads} value heads)")


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


def _my_channels(module: nn.Module, channels: torch.Tensor, key_heads: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's rows of ``channels [key_dim | key_dim | value_dim, ...]`` (the depthwise
    conv's weight or bias): its q, k heads (repeated to ``key_heads``) and its v heads."""
    q, k, v = channels.split([module.key_dim, module.key_dim, module.value_dim])
    keys = _head_slice(key_heads, cp, rank)
    q, k = (w.unflatten(0, (module.num_k_heads, -1)).repeat_interleave(key_heads // module.num_k_heads, 0)[keys]
            for w in (q, k))
    v = v.unflatten(0, (module.num_v_heads, -1))[_head_slice(module.num_v_heads, cp, rank)]
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


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                documents: torch.Tensor | None) -> torch.Tensor:
    import fsdp_turbo.ops.fla  # noqa: F401 - registers the ops
    from fsdp_turbo.ops.registry import get_op

    op = get_op("chunk_gated_delta_rule", q.device.type)
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
    key_heads = key_heads_after_split(module.num_k_heads, module.num_v_heads, cp)
    q, k = _repeat_heads(p.q, key_heads), _repeat_heads(p.k, key_heads)
    # One all-to-all: per destination rank, its q, k, v heads' channels and its heads' b, a.
    parts = [t.unflatten(2, (cp, -1)).flatten(3) for t in (q, k, p.v)]
    parts += [t.unflatten(2, (cp, -1)) for t in (p.b, p.a)]
    whole = sequence_to_channels(torch.cat(parts, dim=-1), group, cp)  # [B, S, channels of my heads]
    conv_channels = (2 * key_heads * module.head_k_dim + module.num_v_heads * module.head_v_dim) // cp
    mixed, b, a = whole.split([conv_channels, module.num_v_heads // cp, module.num_v_heads // cp], dim=-1)
    documents = None if context.documents is None else context.documents.to(whole.device)
    bias = module.conv1d.bias
    mixed = causal_conv(mixed, _my_channels(module, module.conv1d.weight.squeeze(1), key_heads, cp, rank),
                        None if bias is None else _my_channels(module, bias, key_heads, cp, rank), documents)
    mixed = _activation(module.activation)(mixed)
    key_channels = key_heads * module.head_k_dim // cp
    q, k, v = mixed.split([key_channels, key_channels, conv_channels - 2 * key_channels], dim=-1)
    q, k = q.unflatten(-1, (-1, module.head_k_dim)), k.unflatten(-1, (-1, module.head_k_dim))
    v = v.unflatten(-1, (-1, module.head_v_dim))
    heads = _head_slice(module.num_v_heads, cp, rank)
    g = -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads])
    out = _delta_rule(q, k, v, g, b.sigmoid(), documents)  # [B, S, value heads / cp, dv]
    out = heads_to_sequence(out, group, cp)  # [B, S/cp, value heads, dv]
    z = p.z
    out = module.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
    return module.out_proj(out.reshape(*z.shape[:2], -1))


def install_linear_attention(model: nn.Module, layers: Sequence[LinearAttentionLayer], state: CPState) -> None:
    """Replace each layer's forward (the instance's: other models keep theirs)."""
    for layer in layers:
        module = model.get_submodule(layer.name)
        module.forward = functools.partial(ulysses_linear_attention, module, layer.form, state)
