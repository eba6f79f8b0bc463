"""FSDPTurbo's configuration: flat dataclasses in the seed's field names.

Every field is validated when the object is built; the objects are read-only
afterwards. World-size checks run in ``FSDPTurboConfig.validate(world_size)``,
before any collective. Configs load from a dict, a YAML file or a TOML file. Every field
has a docstring where it is defined; ``docs/config.md`` is generated from them
(``tools/gen_config_docs.py``).

One rule for each kind of field:

* **A parallel size turns its feature on** (``tensor_parallel_size=2``); its plan says how.
* **A boolean plus an optional plan turns a memory feature on** (``recompute=True``, with
  ``recompute_plan`` or, unset, the model's repeated blocks).
* **A plan object turns quantization on** (``quantization_plan``).
* **What the model is lives in one section, ``model_facts``**: no feature section holds a
  model fact (its head, blocks, attention, inputs, experts, ``ignore_index``, head counts).

A plan whose feature is off is ignored and named in one warning on rank 0
(``core.features.FEATURE_FIELDS``), so one config serves jobs of several sizes; the one
table that decides whether a feature is on is ``core.features.FEATURES``:

=====================  =======================  ============================================
field                  holds                    its feature is on when
=====================  =======================  ============================================
fsdp_plan              FSDPPlanConfig           the job is launched (world > 1, or a process
                                                group exists), or the plan is set: then one
                                                process gets a one-rank FSDP too
tp_plan                TPPlanConfig             tensor_parallel_size > 1
ep_plan                EPPlanConfig             expert_parallel_size > 1
cp_plan                CPPlanConfig (or None)   context_parallel_size > 1
chunk_loss_plan        ChunkLossPlanConfig      chunk_loss=True
chunk_batch_plan       ChunkBatchPlanConfig     chunk_batch=True; apply_modules None: the blocks
recompute_plan         patterns (or None)       recompute=True; None: the repeated blocks
swap_activation_plan   patterns (or None)       swap_activation=True; None: the repeated blocks
compile_plan           patterns (or None)       compile=True; None: the repeated blocks
quantization_plan      QuantizeConfig (or None) it is given: the plan is the switch
=====================  =======================  ============================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fsdp_turbo.core.choices import check_published_choice
from fsdp_turbo.core.dtypes import parse_dtype
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFactsConfig
from fsdp_turbo.core.module_patches import ModulePatch
from fsdp_turbo.core.parallel_state import ParallelSizes, resolve_parallel_sizes
from fsdp_turbo.core.validation import (
    ConfigSection,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_optional_patterns,
    check_patterns,
    check_sections,
    moved_fields,
)

__all__ = [
    "CPPlanConfig",
    "ChunkBatchPlanConfig",
    "ChunkLossPlanConfig",
    "ConfigError",
    "EPPlanConfig",
    "FSDPPlanConfig",
    "FSDPTurboConfig",
    "QuantizeConfig",
    "TPPlanConfig",
]

SCALE_MODES = ("floor", "rceil")
LOW_PRECISION_GATHER_MODES = ("on-demand", "all")
FSDP_IMPLEMENTATIONS = ("native",)  # torch's fully_shard; the upstream's fine-grained FSDP is not here
RECOMPUTE_POLICIES = ("full", "selective")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
# Stages a rank holds when pipeline_stages_per_rank is unset
PIPELINE_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zbv": 2, "dualpipev": 2}
# The schedules whose backward runs in two passes (input gradients, then weight gradients):
# the weight pass finds the parameters the forward used only if FSDP kept them gathered
SPLIT_BACKWARD_SCHEDULES = ("zbv", "dualpipev")


def _set(obj: Any, name: str, value: Any) -> None:
    # Frozen dataclasses normalise their own fields once, in __post_init__.
    object.__setattr__(obj, name, value)


def unit_patterns(value: Any, field: str) -> Any:
    """The upstream's ``{pattern: per-unit settings}`` form as a pattern list; any other value
    as it is. Per-unit settings are refused: this package sets units through the section's fields."""
    if not isinstance(value, Mapping):
        return value
    for pattern, settings in value.items():
        if settings not in ({}, None):
            raise ConfigError(f"{field}[{pattern!r}]", settings, "give the settings as fsdp_plan fields "
                              "(param_dtype, reshard_after_forward, ...) and list the pattern alone",
                              reason="per-unit fully_shard settings are not supported")
    return list(value)


def _fsdp_implementation(value: Any, field: str) -> str:
    if isinstance(value, str) and value.strip().lower() in FSDP_IMPLEMENTATIONS:
        return value.strip().lower()
    raise ConfigError(field, value, f"use one of {list(FSDP_IMPLEMENTATIONS)}",
                      reason="this package shards with torch's fully_shard only; the upstream's own "
                             "fine-grained FSDP is not part of it")


@dataclass(frozen=True)
class FSDPPlanConfig(ConfigSection):
    """How FSDP2 (``fully_shard``) wraps the model.

    ``apply_modules`` picks the FSDP units (outermost matches); ``None`` means each
    block of the model's repeated block list, e.g. the decoder layers. The root is
    always wrapped last. ``reshard_after_forward=None`` keeps FSDP2's default: units
    reshard, the root does not (its parameters are needed again at once in backward).

    ``keep_after_forward`` names units (among those picked) that keep their parameters
    gathered from forward to backward, as the root does: for the output head as its own
    unit (torchtitan's choice). Then it is gathered when forward reaches it, not when
    forward starts, and its gradients reduce-scatter as soon as its backward ends, not
    with the root's at the end of backward: the same bytes, less memory held.

    ``unit_groups`` makes several modules one unit (one all-gather and one reduce-scatter
    for all of them): each entry is a list of patterns, such as ``[["norm", "output"]]``
    for a final norm and the head (torchtitan's unit; otherwise the norm is the root's).
    A grouped module is in no other unit; the group takes the place of its first module
    in model order, for prefetching and for ``keep_after_forward``.

    The module API's ``expert_fully_shard_modules`` reads the mixed precision, CPU offload,
    ``reshard_after_forward`` and ``hook_modules`` of the plan it is given; its units are the
    caller's own FSDP's.
    """

    _prefix: ClassVar[str] = "fsdp_plan"

    apply_modules: tuple[str, ...] | None = None
    """Patterns of the FSDP units (outermost matches), e.g. ``["model.layers.*"]``. Unset: the model
    facts' repeated blocks. The root is always a unit too, wrapped last. The upstream mapping form
    ``{pattern: {}}`` is read as its patterns (``{}``: no unit but the root); per-unit settings in
    it are refused (give them as this section's fields)."""

    ignored_modules: tuple[str, ...] = ()
    """Patterns of modules FSDP leaves alone: their parameters stay whole on every rank and are
    not all-gathered or reduce-scattered."""

    param_dtype: torch.dtype | str | None = None
    """The dtype FSDP all-gathers parameters in and computes with (mixed precision), e.g.
    ``"bfloat16"``; the sharded master parameters stay in their own dtype. Unset: no cast."""

    reduce_dtype: torch.dtype | str | None = None
    """The dtype gradients are reduce-scattered in, e.g. ``"float32"`` beside a bf16
    ``param_dtype``. Unset: ``param_dtype``."""

    output_dtype: torch.dtype | str | None = None
    """The dtype each unit's forward outputs are cast to (FSDP2's ``MixedPrecisionPolicy.output_dtype``).
    Unset: no cast."""

    cast_forward_inputs: bool = True
    """Whether each unit casts its floating-point forward inputs to ``param_dtype`` (FSDP2's
    ``cast_forward_inputs``)."""

    reshard_after_forward: bool | int | None = None
    """``True`` frees each unit's gathered parameters after its forward (gathered again in
    backward), ``False`` keeps them until backward, an int N reshards to groups of N ranks (often
    the ranks of one node). Unset: FSDP2's default (units reshard, the root does not); beside
    a ``zbv`` or ``dualpipev`` pipeline, whose weight gradients come in a pass of their own,
    unset means ``False``, and resharding is refused."""

    keep_after_forward: tuple[str, ...] = ()
    """Patterns of units (among those picked) that keep their parameters gathered from forward to
    backward, as the root does: for the output head as its own unit, so its gradients
    reduce-scatter as soon as its backward ends."""

    unit_groups: tuple[tuple[str, ...], ...] = ()
    """Lists of patterns, each list one FSDP unit of several modules (one all-gather and one
    reduce-scatter for all), e.g. ``[["norm", "output"]]``. The group takes the place of its first
    module in model order."""

    num_to_forward_prefetch: int = 0
    """How many units ahead forward all-gathers explicitly (0: FSDP2's implicit prefetch)."""

    num_to_backward_prefetch: int = 0
    """How many units ahead backward all-gathers explicitly (0: FSDP2's implicit prefetch)."""

    cpu_offload: bool = False
    """Whether sharded parameters, gradients and the optimizer step live on the host (FSDP2's
    ``CPUOffloadPolicy``)."""

    hook_modules: tuple[str, ...] = ()
    """Patterns of modules (e.g. the decoder layers) whose forward start all-gathers every FSDP unit
    inside them, expert units included, at once rather than unit by unit when each is reached: one
    gathering point per block, as the upstream's hook modules give (there through its own FSDP;
    here through ``unshard(async_op=True)`` of torch's). The same numbers; only when the
    all-gathers are issued changes."""

    fsdp_implementation: str = "native"
    """Which FSDP implements the units: ``"native"`` (torch's ``fully_shard``), the only one this
    package has. The upstream's own fine-grained FSDP is not in it; asking for another is an error,
    never a fallback."""


    def __post_init__(self) -> None:
        p = self._prefix
        _set(self, "apply_modules", check_optional_patterns(unit_patterns(self.apply_modules, f"{p}.apply_modules"),
                                                            f"{p}.apply_modules"))
        _set(self, "hook_modules", check_patterns(self.hook_modules, f"{p}.hook_modules"))
        _set(self, "fsdp_implementation", _fsdp_implementation(self.fsdp_implementation, f"{p}.fsdp_implementation"))
        _set(self, "ignored_modules", check_patterns(self.ignored_modules, f"{p}.ignored_modules"))
        _set(self, "keep_after_forward", check_patterns(self.keep_after_forward, f"{p}.keep_after_forward"))
        if isinstance(self.unit_groups, str) or not isinstance(self.unit_groups, list | tuple):
            raise ConfigError(f"{p}.unit_groups", self.unit_groups, "give a list of pattern lists, e.g. "
                              "[['norm', 'output']]")
        groups = tuple(check_patterns(group, f"{p}.unit_groups") for group in self.unit_groups)
        if any(not group for group in groups):
            raise ConfigError(f"{p}.unit_groups", [list(g) for g in groups], "drop the empty group")
        _set(self, "unit_groups", groups)
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _set(self, name, parse_dtype(getattr(self, name), f"{p}.{name}"))
        check_bool(self.cast_forward_inputs, f"{p}.cast_forward_inputs")
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            check_int(self.reshard_after_forward, f"{p}.reshard_after_forward", minimum=1)
        check_int(self.num_to_forward_prefetch, f"{p}.num_to_forward_prefetch", minimum=0)
        check_int(self.num_to_backward_prefetch, f"{p}.num_to_backward_prefetch", minimum=0)
        check_bool(self.cpu_offload, f"{p}.cpu_offload")


@moved_fields({"head_module": "model_facts.head_module"})
@dataclass(frozen=True)
class TPPlanConfig(ConfigSection):
    """Tensor-parallel plan: Linear (and Embedding) modules picked by pattern. The output head
    it gathers before (sequence parallel) or shards on the vocabulary (loss parallel) is the
    model facts' (``model_facts.head_module``)."""

    _prefix: ClassVar[str] = "tp_plan"

    colwise_parallel: tuple[str, ...] = ()
    """Patterns of the Linear (or Embedding) modules split on their output features, e.g.
    ``["*.q_proj", "*.k_proj", "*.v_proj", "*.up_proj"]``."""

    rowwise_parallel: tuple[str, ...] = ()
    """Patterns of the Linear (or Embedding) modules split on their input features, e.g.
    ``["*.o_proj", "*.down_proj"]``."""

    sequence_parallel: tuple[str, ...] = ()
    """Patterns of the modules between the tensor-parallel regions (the norms) that run on a
    sequence shard (sequence parallel); every norm of the blocks must be listed. Empty: off."""

    loss_parallel: bool = False
    """Whether the output head (which must be in ``colwise_parallel``) keeps its logits sharded
    on the vocabulary and the loss is computed on the shards (loss parallel)."""


    def __post_init__(self) -> None:
        for name in ("colwise_parallel", "rowwise_parallel", "sequence_parallel"):
            _set(self, name, check_patterns(getattr(self, name), f"tp_plan.{name}"))
        check_bool(self.loss_parallel, "tp_plan.loss_parallel")
        both = sorted(set(self.colwise_parallel) & set(self.rowwise_parallel))
        if both:
            raise ConfigError("tp_plan.rowwise_parallel", both[0], "list a pattern in one of colwise/rowwise only",
                              reason="the same pattern is also in tp_plan.colwise_parallel")

    @property
    def is_empty(self) -> bool:
        return not (self.colwise_parallel or self.rowwise_parallel)


@dataclass(frozen=False, eq=True)  # see __setattr__: one field may be set later
class EPPlanConfig(ConfigSection):
    """Expert-parallel plan: which expert containers to shard, and how tokens reach them.

    Read by the facade and by the upstream module API, which callers with their own meshes use
    (LLaMA-Factory's ``fsdpturbo`` backend): ``expert_parallelize_modules(model, ep_mesh, ep_plan)``
    reads ``apply_modules``, ``dispatcher``, ``num_chunks`` and ``gradient_divide_factor``;
    ``expert_fully_shard_modules(model, efsdp_mesh, ep_plan, fsdp_plan)`` reads
    ``apply_efsdp_modules`` and ``gradient_divide_factor``."""

    _prefix: ClassVar[str] = "ep_plan"

    apply_modules: tuple[str, ...] | None = None
    """Patterns of the expert containers to shard, e.g. ``["*mlp.experts"]``. Unset: every expert
    container of the model facts."""

    dispatcher: str = "fused"
    """How tokens reach their experts: ``"eager"`` (a loop over local experts), ``"fused"`` (one
    permute and grouped GEMMs), ``"mc2"`` (fused over token chunks, each chunk's all-to-all
    overlapped with the previous chunk's compute in the forward) or ``"domino"`` (fused over
    independent token slices, each slice's all-to-alls overlapped with the other slices' expert
    GEMMs in the forward and in the backward). The list is expert parallel's own
    (``fsdp_turbo.choices``)."""

    num_chunks: int = 2
    """Token chunks of ``mc2`` and token slices of ``domino``: one chunk's all-to-all is in flight
    while another computes (for ``domino``, in the backward too). More chunks overlap more, each
    with smaller GEMMs; 1 means no overlap."""

    apply_efsdp_modules: tuple[str, ...] | None = None
    """Patterns of the modules whose expert containers expert FSDP shards on the expert mesh, e.g.
    ``["model.layers.*.mlp"]``. Only the expert containers inside a match are sharded there: a
    router or shared expert beside them stays with the dense FSDP. Every expert container must
    be inside one. Unset: every expert container."""

    fixed_router: bool = False
    """For benchmarks: route by position, not by the router. Token ``t``'s ``k``-th choice is expert
    ``(t * top_k + k) mod num_experts`` with weight ``1 / top_k``, on each rank's own tokens, so every
    expert gets the same load (within one slot) whatever the data; dispatch costs can then be measured
    without routing skew. The router still runs, and its outputs are discarded (it gets no gradient)."""

    redundant_experts: int = 0
    """Extra expert slots per EP rank, each holding a replica of a hot expert (DeepSeek's EPLB,
    the upstream's MoonEP). The load counted over recent forwards places the replicas; each
    routed token goes to the least-loaded copy of its expert. A replica's weights are fetched
    from its home rank every forward and its gradient is summed into the expert's own, so
    training is unchanged: only the busiest rank's share of the work drops. Needs
    ``expert_parallel_size > 1``; at most the experts of the other EP ranks."""

    rebalance_every: int = 20
    """Training forwards between placements of the replicas (``redundant_experts``): each
    placement uses the load counted since the previous one. The first is at the first forward."""

    gradient_divide_factor: float | None = None
    """What expert gradients are divided by. Each EP rank's expert gradient sums every source
    rank's tokens (the all-to-all's backward), so the mean over the job's data-parallel ranks
    divides by their count. Unset: the dense data-parallel size (facade), or the EP x expert-FSDP
    mesh sizes (module API). The one field that may be set after the plan is built, as the
    upstream's clients do (``ep_plan.gradient_divide_factor = float(ep * efsdp)``)."""


    def __post_init__(self) -> None:
        _set(self, "apply_modules", check_optional_patterns(self.apply_modules, "ep_plan.apply_modules"))
        _set(self, "dispatcher", check_published_choice(self.dispatcher, "ep_plan.dispatcher"))
        check_int(self.num_chunks, "ep_plan.num_chunks", minimum=1)
        check_bool(self.fixed_router, "ep_plan.fixed_router")
        check_int(self.redundant_experts, "ep_plan.redundant_experts", minimum=0)
        check_int(self.rebalance_every, "ep_plan.rebalance_every", minimum=1)
        _set(self, "apply_efsdp_modules",
             check_optional_patterns(self.apply_efsdp_modules, "ep_plan.apply_efsdp_modules"))
        _set(self, "gradient_divide_factor", _divide_factor(self.gradient_divide_factor))
        _set(self, "_sealed", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # Read-only like every section, but for the divide factor: it is validated on the way in.
        if not getattr(self, "_sealed", False):
            _set(self, name, value)
        elif name == "gradient_divide_factor":
            _set(self, name, _divide_factor(value))
        else:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r} (of ep_plan only "
                                                  "gradient_divide_factor may be set after it is built)")


def _divide_factor(value: Any) -> float | None:
    field_name = "ep_plan.gradient_divide_factor"
    return None if value is None else check_float(value, field_name, minimum=0.0, strict=True)


@moved_fields({name: f"model_facts.{name}"
               for name in ("attention_function", "attention_modules", "token_input", "position_input")})
@dataclass(frozen=True)
class CPPlanConfig(ConfigSection):
    """Context parallel. ``mode``: ``ulysses`` (all-to-all to head shards: bounded by the
    head count), ``ring`` (K/V chunks travel around all ``context_parallel_size`` ranks;
    any head count), ``hybrid`` (Ulysses over ``ulysses_size`` ranks inside a ring) or
    ``kv_allgather`` (each rank keeps its queries and all-gathers the keys and values;
    with ``ulysses_size``, inside Ulysses). ``load_balance``: ring and KV all-gather chunks
    in zig-zag order, so every rank does the same causal work.

    Ring and KV all-gather compute only what the mask keeps: a pair of chunks nothing sees is
    skipped, and one the mask cuts is computed in query blocks of ``block_size`` rows, each
    on the keys its rows see.

    The core attention it wraps and the forward arguments it splits are model facts
    (``model_facts.attention_function`` / ``attention_modules`` / ``token_input`` /
    ``position_input``). Ulysses runs that attention on the whole sequence for a head
    shard; ring, hybrid and KV all-gather replace it by causal softmax attention (``scale`` and
    ``enable_gqa`` honoured; a mask, dropout or ``is_causal=False`` is refused at the call)."""

    _prefix: ClassVar[str] = "cp_plan"

    mode: str = "ulysses"
    """``"ulysses"`` (all-to-all to head shards; the heads must split over ``context_parallel_size``),
    ``"ring"`` (key/value chunks travel around the ranks; any head count), ``"hybrid"``
    (Ulysses over ``ulysses_size`` ranks inside a ring of the rest) or ``"kv_allgather"``
    (each rank all-gathers the keys and values of its group; any head count; with
    ``ulysses_size``, Ulysses over that many ranks inside a KV all-gather of the rest)."""

    ulysses_size: int | None = None
    """The Ulysses ranks inside each ring or KV all-gather member: with mode ``"hybrid"``
    (required) or ``"kv_allgather"`` (optional), a divisor of ``context_parallel_size`` of at
    least 2."""

    load_balance: bool = True
    """Whether ring, hybrid and KV all-gather cut the sequence in zig-zag chunks, so every rank
    does the same causal work."""

    block_size: int = 64
    """Ring and KV all-gather: the query rows of one block where the mask cuts a pair of chunks
    (a window, chunks, packed documents). Each block computes only the keys its rows see, so
    the work exceeds what the mask keeps by at most about half a ``block_size`` square per block
    (nothing for a window the block size divides: its edge runs as a reversed causal square; on
    CPU, whose kernel computes a causal square whole, each block is one masked tile over the
    keys it sees); smaller blocks waste less, in more kernel calls."""

    def __post_init__(self) -> None:
        _set(self, "mode", check_choice(self.mode, "cp_plan.mode", ("ulysses", "ring", "hybrid", "kv_allgather")))
        check_bool(self.load_balance, "cp_plan.load_balance")
        check_int(self.block_size, "cp_plan.block_size", minimum=1)
        if self.ulysses_size is not None:
            check_int(self.ulysses_size, "cp_plan.ulysses_size", minimum=1)
        if self.mode == "hybrid" and self.ulysses_size is None:
            raise ConfigError("cp_plan.ulysses_size", None, "give ulysses_size with mode 'hybrid'",
                              reason="hybrid runs Ulysses over ulysses_size ranks inside a ring")
        if self.mode in ("ulysses", "ring") and self.ulysses_size is not None:
            raise ConfigError("cp_plan.ulysses_size", self.ulysses_size,
                              "give ulysses_size only with mode 'hybrid' or 'kv_allgather'",
                              reason=f"mode is {self.mode!r}")
        if self.ulysses_size is not None and self.ulysses_size < 2:
            raise ConfigError("cp_plan.ulysses_size", self.ulysses_size,
                              f"use at least 2 (1 is mode '{'ring' if self.mode == 'hybrid' else self.mode}' alone)")

    @property
    def nested(self) -> bool:
        """Ulysses inside a ring or a KV all-gather: the CP group splits into two."""
        return self.mode != "ulysses" and self.ulysses_size is not None


@moved_fields({"head_module": "model_facts.head_module", "ignore_index": "model_facts.ignore_index"})
@dataclass(frozen=True)
class ChunkLossPlanConfig(ConfigSection):
    """Chunked cross-entropy: the full [tokens, vocab] logits are never built. The head it
    replaces and the label it ignores are model facts (``model_facts.head_module``,
    ``model_facts.ignore_index``)."""

    _prefix: ClassVar[str] = "chunk_loss_plan"

    chunk_size: int = 1024
    """Tokens per chunk: the logits of this many tokens exist at a time instead of all
    ``[tokens, vocab]``."""

    z_loss_weight: float = 0.0
    """Weight of the z-loss (``logsumexp(logits)^2``, PaLM's), added to the cross-entropy;
    0 turns it off."""

    logit_softcap: float | None = None
    """Soft-cap the logits as ``cap * tanh(logits / cap)`` before the loss (Gemma's
    ``final_logit_softcapping``). Unset: the model config's ``final_logit_softcapping``, if any."""


    def __post_init__(self) -> None:
        check_int(self.chunk_size, "chunk_loss_plan.chunk_size", minimum=1)
        _set(self, "z_loss_weight", check_float(self.z_loss_weight, "chunk_loss_plan.z_loss_weight", minimum=0.0))
        if self.logit_softcap is not None:
            _set(self, "logit_softcap",
                 check_float(self.logit_softcap, "chunk_loss_plan.logit_softcap", minimum=0.0, strict=True))


@dataclass(frozen=True)
class ChunkBatchPlanConfig(ConfigSection):
    """Chunked batch: the picked modules run their forward in slices of the batch, so the
    forward's transient intermediates exist for one slice at a time (with recompute, the
    backward's re-run too). The same result as one call (rows are independent)."""

    _prefix: ClassVar[str] = "chunk_batch_plan"

    apply_modules: tuple[str, ...] | None = None
    """Patterns of the modules to slice (outermost matches), e.g. ``["model.layers.*.mlp"]``.
    Unset: the model facts' repeated blocks."""

    num_chunks: int = 2
    """Slices of the batch (fewer when a batch has fewer rows)."""


    def __post_init__(self) -> None:
        _set(self, "apply_modules", check_optional_patterns(self.apply_modules, "chunk_batch_plan.apply_modules"))
        check_int(self.num_chunks, "chunk_batch_plan.num_chunks", minimum=2)


@moved_fields({"head_module": "model_facts.head_module"})
@dataclass(frozen=True)
class QuantizeConfig(ConfigSection):
    """MX block quantization for training, applied by converters picked by pattern. The
    default plan leaves the model facts' output head (``model_facts.head_module``) in high
    precision."""

    _prefix: ClassVar[str] = "quantization_plan"

    quant_format: str = "E4M3"
    """The MX element format: ``"E4M3"``, ``"E5M2"`` or ``"HIF8"`` (case-insensitive). The list is
    turbo-quant's format table (``fsdp_turbo.choices``)."""

    block_size: int = 32
    """Elements that share one power-of-two (E8M0) scale, along the reduction dimension."""

    scale_mode: str = "floor"
    """How a block's scale is rounded: ``"floor"`` (OCP MX: may clip the block max) or
    ``"rceil"`` (round up: never clips)."""

    apply_modules: tuple[str, ...] | None = None
    """Patterns of the modules to convert (each with the modules under it). Unset: every module
    a converter handles, except the output head, MoE routers and modules whose dims do not
    divide ``block_size``."""

    ignored_modules: tuple[str, ...] = ()
    """Patterns of modules left in high precision."""

    converters: tuple[str, ...] | None = None
    """The converters to use, by registered name (``"mx_linear"``, ``"mx_experts"``, ...). Unset: all
    registered converters."""

    emax_elem: int | None = None
    """The element format's largest exponent the block scale aims the block max at, in
    ``[0, max_exponent]``. Unset: the format's own (HIF8 gradients: 7)."""

    store_frozen_weights: bool = False
    """QLoRA-MX: keep every frozen weight of a converted Linear (a LoRA layer's ``base_layer``) or
    fused MoE experts module in ``quant_format``: one byte per element and one E8M0 scale per block,
    about 0.52x of bf16 per rank, and FSDP all-gathers those bytes. The frozen weight is dequantized
    after the all-gather for the forward and the input-gradient GEMMs; trainable adapters stay high
    precision. Under tensor parallel each rank holds the packing of its shard. Works on meta-built
    models (``load_pretrained`` quantizes each rank's rows); saves write the dequantized values. A
    picked weight that trains is an error, as is LoRA on the experts themselves
    (``target_parameters``) over frozen MX experts; a Linear whose rowwise TP shard is not whole
    blocks stays high precision (an error when ``apply_modules`` picks it)."""

    low_precision_all_gather: bool = False
    """FSDP all-gathers each MX-trained weight (Linear layers and fused MoE experts) as the MX bytes
    its GEMMs read (one code per element and one E8M0 scale per block, ``1 + 1/block_size`` bytes per
    element, against 2 for bf16 and 4 for fp32) instead of the weight itself. Each rank quantizes its
    own fp32 shard, so training is unchanged. A Linear whose FSDP shard (of what tensor parallel
    leaves each rank) is not whole blocks along ``out_features``, and experts that expert FSDP splits
    within an expert (fewer local experts than shard ranks), are gathered in high precision (named in
    one warning). Not with ``compile``."""

    low_precision_all_gather_mode: str = "on-demand"
    """Which MX orientations a gather carries. ``"on-demand"``: the forward's gather the forward
    GEMM's blocks, the backward's gather the input-gradient GEMM's; where a forward runs again in
    the backward (recompute) or FSDP keeps a weight from forward to backward (the root), the missing
    orientation is gathered when a GEMM needs it. ``"all"``: every gather carries both (twice the
    bytes, no extra collectives)."""

    def __post_init__(self) -> None:
        p = self._prefix
        _set(self, "quant_format", check_published_choice(self.quant_format, f"{p}.quant_format", upper=True))
        check_int(self.block_size, f"{p}.block_size", minimum=1)
        _set(self, "scale_mode", check_choice(self.scale_mode, f"{p}.scale_mode", SCALE_MODES))
        _set(self, "apply_modules", check_optional_patterns(self.apply_modules, f"{p}.apply_modules"))
        _set(self, "ignored_modules", check_patterns(self.ignored_modules, f"{p}.ignored_modules"))
        _set(self, "converters", check_optional_patterns(self.converters, f"{p}.converters"))
        if self.emax_elem is not None:
            check_int(self.emax_elem, f"{p}.emax_elem")
        check_bool(self.store_frozen_weights, f"{p}.store_frozen_weights")
        check_bool(self.low_precision_all_gather, f"{p}.low_precision_all_gather")
        _set(self, "low_precision_all_gather_mode", check_choice(
            self.low_precision_all_gather_mode, f"{p}.low_precision_all_gather_mode", LOW_PRECISION_GATHER_MODES))


@moved_fields({"swap_activation_force": "swap_force", "swap_optimizer_force": "swap_force"})
@dataclass(frozen=True)
class FSDPTurboConfig(ConfigSection):
    """The whole FSDPTurbo configuration, in the seed's flat field names.

    ``fully_shard_parallel_size=-1`` takes every rank the other sizes leave.
    """

    _nested: ClassVar[dict[str, type]] = {
        "fsdp_plan": FSDPPlanConfig,
        "tp_plan": TPPlanConfig,
        "ep_plan": EPPlanConfig,
        "cp_plan": CPPlanConfig,
        "chunk_loss_plan": ChunkLossPlanConfig,
        "chunk_batch_plan": ChunkBatchPlanConfig,
        "quantization_plan": QuantizeConfig,
        "model_facts": ModelFactsConfig,
    }

    model_facts: ModelFactsConfig = field(default_factory=ModelFactsConfig)
    """What the model is: its repeated blocks, output head, embedding, core attention, input
    names, expert containers, ``ignore_index`` and head counts. Hugging Face models need none of
    it; see ``ModelFactsConfig``."""

    data_parallel_size: int = 1
    """Replicas of the model (HSDP's replicate dimension): gradients are all-reduced across them.
    A parallel size turns its feature on; 1 is off."""

    fully_shard_parallel_size: int = -1
    """Ranks each replica's parameters, gradients and optimizer states are sharded over
    (FSDP2). ``-1`` takes every rank the other sizes leave."""

    fsdp_plan: FSDPPlanConfig = field(default_factory=FSDPPlanConfig)
    """How FSDP2 wraps the model: units, mixed precision, offload, prefetch. FSDP is on whenever
    the job is launched; setting a plan on one process turns on a one-rank FSDP."""

    tensor_parallel_size: int = 1
    """Ranks each Linear of ``tp_plan`` is split over (tensor parallel); more than 1 turns it on
    and needs ``tp_plan``."""

    tp_plan: TPPlanConfig | None = None
    """Which modules tensor parallel splits, and how (sequence and loss parallel)."""

    expert_parallel_size: int = 1
    """Ranks the experts of each MoE layer are split over (expert parallel); more than 1 turns it
    on and needs ``ep_plan``."""

    expert_fully_shard_parallel_size: int | None = None
    """Ranks the expert parameters are FSDP-sharded over, beside expert parallel. Unset:
    ``world / (expert_parallel_size * edp)``, with the expert replicas
    ``edp = gcd(data_parallel_size, world / expert_parallel_size)``."""

    ep_plan: EPPlanConfig | None = None
    """Which expert containers expert parallel shards, and its dispatcher."""

    router_bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free load balancing: after each training forward of an MoE
    layer, its router's ``e_score_correction_bias`` moves by this rate towards balance (up for
    experts below the mean load, down above it), from the load of every rank. 0 (the default)
    leaves the bias as loaded; the paper used 0.001. Needs routers with that bias (DeepSeek-V3,
    GLM-4.5 MoE, Kimi K2 style); any layout, with or without expert parallel."""

    context_parallel_size: int = 1
    """Ranks the sequence is split over (context parallel: Ulysses, ring or hybrid); more than 1
    turns it on."""

    cp_plan: CPPlanConfig | None = None
    """How context parallel splits attention. Unset: Ulysses with zig-zag load balance."""

    pipeline_parallel_size: int = 1
    """Pipeline stages' rank groups: the decoder layers are split into stages, each run by
    ``world / pipeline_parallel_size`` ranks (which hold every other dimension of their own),
    and micro-batches flow through them (``torch.distributed.pipelining``). More than 1 turns
    it on; the training step is then ``model.fsdp_turbo_pipeline.step(input_ids, labels)``."""

    pipeline_schedule: str = "1f1b"
    """``gpipe`` (every forward, then every backward), ``1f1b`` (one forward, one backward),
    ``interleaved_1f1b`` (several stages a rank, looped), ``zbv`` (zero-bubble V: two stages a
    rank, the backward split into input and weight gradients) or ``dualpipev`` (DualPipe's V).
    Default ``1f1b``."""

    pipeline_microbatches: int | None = None
    """Micro-batches each step's batch is split into for the pipeline; the batch's rows must
    divide by it. Unset: the number of stages (``1f1b`` and ``dualpipev`` need at least that
    many)."""

    pipeline_stages_per_rank: int | None = None
    """Stages each rank holds: 1 for ``gpipe`` and ``1f1b``; 2 for ``zbv`` and ``dualpipev``
    (their V); 2 or more for ``interleaved_1f1b`` (unset: 2)."""

    pipeline_split_points: tuple[int, ...] = ()
    """The first decoder layer of every stage but the first, e.g. ``[10, 20, 30]`` for four
    stages: declared splits. Empty (the default): the layers split evenly, which needs their
    number to divide by the stages. Embedding and head go to the first and last stage."""

    recompute: bool = False
    """Whether activations of the picked blocks are recomputed in backward instead of kept
    (activation checkpointing). A boolean and an optional plan turn a memory feature on."""

    recompute_plan: tuple[str, ...] | None = None
    """Patterns of the modules to recompute (outermost matches). Unset: the model facts'
    repeated blocks."""

    recompute_policy: str | tuple[str, ...] = "full"
    """``"full"`` recomputes everything, ``"selective"`` keeps the matmul and attention outputs and
    recomputes the rest; or a list of ATen ops to keep, e.g. ``["aten.mm"]``."""

    chunk_batch: bool = False
    """Whether the picked modules (default: the repeated blocks) run their forward in slices of
    the batch, to cut their activation peak."""

    chunk_batch_plan: ChunkBatchPlanConfig = field(default_factory=ChunkBatchPlanConfig)
    """The modules chunk_batch slices and the number of slices."""

    chunk_loss: bool = False
    """Whether the cross-entropy is computed chunk by chunk, so the full ``[tokens, vocab]``
    logits are never built."""

    chunk_loss_plan: ChunkLossPlanConfig = field(default_factory=ChunkLossPlanConfig)
    """The chunk size and the loss options of the chunked loss."""

    swap_activation: bool = False
    """Whether the picked blocks' saved activations move to the host after forward and come back
    before backward, overlapped with compute on a copy stream."""

    swap_activation_plan: tuple[str, ...] | None = None
    """Patterns of the blocks whose activations are swapped. Unset: the model facts' repeated
    blocks."""

    swap_optimizer: bool = False
    """Whether the optimizer states live on the host and move to the device, a parameter group
    at a time, for the optimizer step."""

    swap_force: bool = False
    """Whether the swaps (activation and optimizer) run on a device without copy streams, such as
    the CPU, where they save nothing and are otherwise skipped with a warning (for tests)."""

    quantization_plan: QuantizeConfig | None = None
    """MX block quantization for training. A plan object turns quantization on; unset: off."""

    compile: bool = False
    """Whether each picked block is compiled with ``torch.compile``."""

    compile_plan: tuple[str, ...] | None = None
    """Patterns of the modules to compile (outermost matches). Unset: the model facts' repeated
    blocks."""

    compile_backend: str = "inductor"
    """The ``torch.compile`` backend, e.g. ``"inductor"`` or ``"aot_eager"``."""

    device_type: str | None = None
    """``"cpu"``, ``"cuda"`` or ``"npu"``. Unset: the accelerator PyTorch finds, else the CPU."""

    module_patches: tuple[ModulePatch, ...] = ()
    """Members of the model's module classes replaced before anything is planned, e.g. a faster
    forward: a list of ``{target: package.module.Class.member, replacement: package.function,
    modules: [patterns]}`` (``modules`` unset: every instance). See ``ModulePatch``."""


    def __post_init__(self) -> None:
        check_int(self.data_parallel_size, "data_parallel_size", minimum=1)
        check_int(self.fully_shard_parallel_size, "fully_shard_parallel_size", minimum=1, allow=(-1,))
        check_int(self.tensor_parallel_size, "tensor_parallel_size", minimum=1)
        check_int(self.expert_parallel_size, "expert_parallel_size", minimum=1)
        check_int(self.context_parallel_size, "context_parallel_size", minimum=1)
        self._check_pipeline_fields()
        check_float(self.router_bias_update_rate, "router_bias_update_rate", minimum=0.0)
        if self.expert_fully_shard_parallel_size is not None:
            check_int(self.expert_fully_shard_parallel_size, "expert_fully_shard_parallel_size", minimum=1)
        for name, kind in self._nested.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                value = kind.from_dict(dict(value))
                _set(self, name, value)
            if value is not None and not isinstance(value, kind):
                raise ConfigError(name, value, f"use {kind.__name__}(...) or a mapping of its fields")
        self._check_plans_match_sizes()
        self._check_memory_fields()
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ConfigError("compile_backend", self.compile_backend,
                              "name a torch.compile backend, e.g. 'inductor' or 'aot_eager'")
        quant = self.quantization_plan
        if self.chunk_batch and self.compile:
            raise ConfigError("chunk_batch", True, "turn chunk_batch or compile off",
                              reason="compile traces each block's forward whole; chunk_batch slices it")
        if quant is not None and quant.low_precision_all_gather and self.compile:
            raise ConfigError("quantization_plan.low_precision_all_gather", True,
                              "set it to false under compile, or turn compile off",
                              reason="compiled blocks cannot take weights gathered as MX bytes yet")
        if self.device_type is not None:
            _set(self, "device_type", check_choice(self.device_type, "device_type", ("cpu", "cuda", "npu")))
        _set(self, "module_patches", check_sections(
            self.module_patches, ModulePatch, "module_patches", allow_empty=True,
            example="[{target: pkg.module.Class.forward, replacement: my_pkg.fast_forward}]"))

    def _check_pipeline_fields(self) -> None:
        check_int(self.pipeline_parallel_size, "pipeline_parallel_size", minimum=1)
        _set(self, "pipeline_schedule", check_choice(self.pipeline_schedule, "pipeline_schedule", PIPELINE_SCHEDULES))
        if self.pipeline_microbatches is not None:
            check_int(self.pipeline_microbatches, "pipeline_microbatches", minimum=1)
        if self.pipeline_stages_per_rank is not None:
            check_int(self.pipeline_stages_per_rank, "pipeline_stages_per_rank", minimum=1)
        points = self.pipeline_split_points
        if isinstance(points, str) or not isinstance(points, list | tuple) or not all(
                isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in points) or list(points) != sorted(
                set(points)):
            raise ConfigError("pipeline_split_points", points, "give increasing layer indices >= 1, e.g. [10, 20, 30]")
        _set(self, "pipeline_split_points", tuple(points))

    def _check_plans_match_sizes(self) -> None:
        tp = self.tensor_parallel_size
        if tp > 1 and (self.tp_plan is None or self.tp_plan.is_empty):
            raise ConfigError("tp_plan", self.tp_plan,
                              "give TPPlanConfig(colwise_parallel=[...], rowwise_parallel=[...])",
                              reason=f"tensor_parallel_size={tp} needs a plan")
        # A plan for a feature that is off is not an error: the facade names it in one warning
        # (core.features.FEATURE_FIELDS), so one config serves jobs of different sizes.
        if self.expert_parallel_size > 1 and self.ep_plan is None:
            raise ConfigError("ep_plan", None, "give EPPlanConfig(apply_modules=['*mlp.experts*'])",
                              reason=f"expert_parallel_size={self.expert_parallel_size} needs a plan")

    def _check_memory_fields(self) -> None:
        for flag, plan in (("recompute", "recompute_plan"), ("swap_activation", "swap_activation_plan"),
                           ("compile", "compile_plan")):
            check_bool(getattr(self, flag), flag)
            _set(self, plan, check_optional_patterns(getattr(self, plan), plan))
        policy = self.recompute_policy
        if isinstance(policy, str):
            _set(self, "recompute_policy", check_choice(policy, "recompute_policy", RECOMPUTE_POLICIES))
        else:
            _set(self, "recompute_policy", check_patterns(policy, "recompute_policy"))
        for flag in ("chunk_loss", "chunk_batch", "swap_optimizer", "swap_force"):
            check_bool(getattr(self, flag), flag)

    # ----- world-size checks ---------------------------------------------------------
    def validate(self, world_size: int) -> ParallelSizes:
        """Check the sizes against ``world_size``; return the resolved sizes. No collectives."""
        return resolve_parallel_sizes(
            world_size=world_size,
            data_parallel_size=self.data_parallel_size,
            fully_shard_parallel_size=self.fully_shard_parallel_size,
            context_parallel_size=self.context_parallel_size,
            tensor_parallel_size=self.tensor_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
            expert_fully_shard_parallel_size=self.expert_fully_shard_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )
