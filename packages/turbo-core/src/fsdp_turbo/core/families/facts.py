"""What a model family states about itself: :class:`Family` and the facts it is made of.

A family is one file of this package that builds one :class:`Family` and registers it. It
states, as data, what the features need to know and cannot see in the module structure:

* the attention kind of each layer (``layer_kinds``: softmax, sliding window, chunked,
  linear, sparse or compressed; HF's ``config.layer_types`` by default);
* the parameters an attention holds itself, one entry per head (``head_parameters``:
  gpt-oss's sinks), the modules whose output every head reads (``latent_modules``: MLA's
  low-rank projections) and the norms over every head's channels at once (``heads_norms``:
  MiniMax-M2's q/k norms);
* its routers and indexers (modules that choose experts or keys), its linear-attention
  forms, and the config names of its sizes;
* member patches its modules need to fit the features' contracts (``patches``).

Module facts name module *classes* by name (turbo-core never imports transformers); model
facts are keyed by the HF ``config.model_type``. Nothing here reads a model: resolving the
facts of one model is ``core.model_facts``' job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class AttentionKind(StrEnum):
    """How a layer mixes tokens, as context and tensor parallel must treat it."""

    SOFTMAX = "softmax"  # causal softmax attention over every earlier position
    SLIDING = "sliding"  # ditto, over the last `window` positions
    CHUNKED = "chunked"  # ditto, within fixed blocks of `chunk` positions (Llama 4)
    LINEAR = "linear"  # a recurrent mixer carrying a state along the sequence (Gated DeltaNet, KDA)
    SPARSE = "sparse"  # softmax over the keys an indexer picks for each query (DeepSeek Sparse Attention)
    COMPRESSED = "compressed"  # a window of keys plus entries compressed from the whole sequence (DeepSeek-V4)
    UNKNOWN = "unknown"  # a layer type the model's config declares and no family explains


@dataclass(frozen=True)
class LayerKind:
    """One layer's attention kind, with what its mask needs. ``kv_heads`` / ``head_dim`` are
    set where the layer's own differ from the model's (Gemma 4's global layers)."""

    kind: AttentionKind = AttentionKind.SOFTMAX
    window: int | None = None  # sliding: keys within the last `window` positions
    chunk: int | None = None  # chunked: keys in the query's block of `chunk` positions
    declared: str = ""  # the config's own name for it (``layer_types`` entry)
    kv_heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True)
class HeadParameter:
    """A parameter an attention module holds itself (not in a sub-Linear), one entry per
    query head along ``dim``: it splits with the heads (tensor parallel) and is cut to a
    rank's heads (Ulysses)."""

    module_class: str  # the attention's class name
    parameter: str
    dim: int = 0
    what: str = ""  # e.g. "attention sinks", named in plans and errors


@dataclass(frozen=True)
class LatentModule:
    """A child of an attention that computes what every head reads (MLA's low-rank query and
    key/value projections and their norms): whole on every tensor-parallel rank, beside the
    head-split projections. ``shared_tail`` counts the latent's last outputs that every head
    reads directly (MLA's rotary key): an int, or the attention's attribute holding it."""

    module_class: str  # the attention's class name
    child: str  # the child module's name, e.g. "kv_a_proj_with_mqa"
    shared_tail: int | str | None = None


@dataclass(frozen=True)
class HeadsNorm:
    """An RMS norm over every head's channels of a projection at once (MiniMax-M2's ``q_norm``
    over ``[heads * head_dim]``): split with the projection's heads, its statistic is summed
    over the tensor-parallel ranks."""

    module_class: str  # the attention's class name
    child: str  # the norm, e.g. "q_norm"
    projection: str  # the projection whose output it normalises, e.g. "q_proj"


@dataclass(frozen=True)
class SizeNames:
    """The config attribute names of each size, in the order they are tried."""

    hidden: tuple[str, ...] = ("hidden_size", "n_embd", "d_model")
    layers: tuple[str, ...] = ("num_hidden_layers", "n_layer", "num_layers")
    vocab: tuple[str, ...] = ("vocab_size",)
    heads: tuple[str, ...] = ("num_attention_heads", "n_head", "num_heads")
    kv_heads: tuple[str, ...] = ("num_key_value_heads", "n_kv_heads")
    head_dim: tuple[str, ...] = ("qk_head_dim", "head_dim")  # queries and keys (MLA: nope + rope)
    v_head_dim: tuple[str, ...] = ("v_head_dim", "head_dim")
    intermediate: tuple[str, ...] = ("intermediate_size",)  # a dense MLP's width
    moe_intermediate: tuple[str, ...] = ("moe_intermediate_size",)  # one routed expert's width
    experts: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
    top_k: tuple[str, ...] = ("num_experts_per_tok", "moe_topk", "experts_per_token")


@dataclass(frozen=True)
class MemberPatch:
    """A member of a module class replaced on every instance before anything is planned
    (``utils.patch.patch_model_members``' rules), where the family's own code does not fit a
    feature's contract (Llama 4's dense expert call). ``replacement`` must compute what the
    member computed."""

    module_class: str
    member: str
    replacement: Callable[..., Any]
    why: str


@dataclass(frozen=True)
class Family:
    """Everything a model family states. Only ``name`` is required: an unset fact is HF's
    convention (see each field)."""

    name: str
    model_types: tuple[str, ...] = ()
    """The HF ``config.model_type`` values this family's model-level facts (layer kinds,
    sizes) apply to."""
    layer_kinds: Callable[[Any, int], Sequence[LayerKind]] | None = None
    """``(config, layers) -> one LayerKind per layer``. Unset: ``config.layer_types``
    (``full_attention``, ``sliding_attention``, ``chunked_attention``, ``linear_attention``)."""
    attention_classes: tuple[str, ...] = ()
    """Classes of its token mixers beside HF's convention (a class whose name ends in
    ``Attention``)."""
    head_parameters: tuple[HeadParameter, ...] = ()
    latent_modules: tuple[LatentModule, ...] = ()
    heads_norms: tuple[HeadsNorm, ...] = ()
    routers: tuple[str, ...] = ()
    """Classes of its routers beside HF's convention (a child ``gate`` or ``router`` beside the
    experts). Left in high precision by quantization."""
    indexers: tuple[str, ...] = ()
    """Classes of modules that pick keys for a sparse attention (DSA's indexer): their
    outputs are selections, they get no gradient and they stay in high precision."""
    linear_attention: tuple[type, ...] = ()
    """Its linear-attention forms (``families.linear_forms.LinearAttentionForm``)."""
    sizes: SizeNames = field(default_factory=SizeNames)
    sizes_of: Callable[[Any], dict[str, int | None]] | None = None
    """``config -> {size: value}`` for sizes a config does not hold under one name
    (overrides ``sizes``)."""
    patches: tuple[MemberPatch, ...] = ()
    compressors: tuple[str, ...] = ()
    """Classes of modules inside an attention that compress the whole sequence into extra key/value
    entries every query may read (DeepSeek-V4's): context parallel runs them on the gathered sequence."""
    after_blocks: tuple[str, ...] = ()
    """Patterns of modules outside the repeated blocks, beside the final norm, that run after them
    (DeepSeek-V4's hyper-connection head): under sequence parallel they see each rank's tokens."""
    before_blocks: tuple[str, ...] = ()
    """Patterns of modules outside the repeated blocks that run before them, on the whole
    sequence (Gemma 4's per-layer input projection and norm), as the embedding does."""
    block_token_inputs: tuple[str, ...] = ()
    """Arguments of its repeated blocks that hold one value per token beside the hidden states
    (Gemma 4's ``per_layer_input``): sequence parallel cuts them with the hidden states."""
    query_scales: Callable[[Any, Any], Any] | None = None
    """``(attention module, index [S]) -> scale [S] or None``: for a family whose attention
    scales its queries by a function of their index in the row (Llama 4's temperature tuning on
    its NoPE layers), not of ``position_ids``; None for a module that scales none. Context
    parallel corrects a chunk's queries by the global index."""
