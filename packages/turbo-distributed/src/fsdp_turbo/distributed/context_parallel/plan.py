"""What context parallel will wrap, checked before anything is changed or sent."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFacts, import_attention_function
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow
from fsdp_turbo.distributed.context_parallel.context import LayerSpec
from fsdp_turbo.distributed.context_parallel.inputs import InputNames
from fsdp_turbo.distributed.context_parallel.linear_attention import LinearAttentionLayer
from fsdp_turbo.fsdp_turbo_config import CPPlanConfig

if TYPE_CHECKING:
    from fsdp_turbo.core.memory_estimate import MemoryModel

# Core attentions the wrapper can hand the whole sequence to (flex needs a block mask
# built for the full sequence, paged ones a cache: not supported).
HF_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


@dataclass(frozen=True)
class CPTarget:
    """An HF model's attention implementation, a core attention function by path, or the
    modules whose forward is a core attention."""

    hf_implementation: str | None = None
    function_path: str | None = None
    # The function the path names, imported once when planning; equal paths make equal plans.
    function: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    module_names: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.module_names:
            more = len(self.module_names) - 1
            return self.module_names[0] + (f" (and {more} more)" if more else "")
        return self.function_path or f"HF attention '{self.hf_implementation}'"

    @property
    def layers(self) -> int:
        """How many attention calls a forward must make through the wrapper (0: unknown)."""
        return len(self.module_names)


@dataclass(frozen=True)
class CPPlan(FeaturePlan):
    """Ulysses (or a ring) over ``size`` ranks around ``target``."""

    size: int
    target: CPTarget
    attention_layers: int = 0  # the wrapper must run in this many layers each forward (0: unchecked)
    mode: str = "ulysses"
    load_balance: bool = True  # ring / hybrid / KV all-gather: zig-zag chunks
    ulysses_size: int = 0  # hybrid (or Ulysses x KV all-gather): the Ulysses ranks inside each member
    block_size: int = 64  # ring / KV all-gather: the query rows of a block where the mask cuts a tile
    inputs: InputNames = field(default_factory=InputNames)  # the forward arguments split, and given positions
    linear_layers: tuple[LinearAttentionLayer, ...] = ()  # run by Ulysses' linear-attention forward
    # the softmax attention modules (by the model facts), each with its window, chunk and per-head tensors
    layers: tuple[LayerSpec, ...] = ()
    indexers: tuple[str, ...] = ()  # sparse attention's indexers: their keys gathered over the sequence
    compressors: tuple[str, ...] = ()  # compressed attention's compressors: run on the gathered sequence

    @property
    def nested(self) -> bool:
        """Ulysses inside a ring or a KV all-gather: the CP group splits into two."""
        return self.mode != "ulysses" and self.ulysses_size > 1

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(spec.index for spec in self.layers if spec.window is not None)

    @property
    def chunked_layers(self) -> tuple[int, ...]:
        return tuple(spec.index for spec in self.layers if spec.chunk is not None)

    def describe(self) -> tuple[PlanRow, ...]:
        chunks = "zig-zag chunks" if self.load_balance else "contiguous chunks"
        if self.mode == "ring":
            how = f"ring over {self.size} ranks ({chunks}) on {self.target.describe()} calls"
        elif self.mode == "hybrid":
            how = (f"Ulysses {self.ulysses_size} x ring {self.size // self.ulysses_size} ({chunks}) on "
                   f"{self.target.describe()} calls")
        elif self.mode == "kv_allgather":
            inner = f"Ulysses {self.ulysses_size} x " if self.nested else ""
            members = self.size // self.ulysses_size if self.nested else self.size
            how = f"{inner}K/V all-gathered over {members} ranks ({chunks}) on {self.target.describe()} calls"
        else:
            how = self.target.describe()
        rows = [PlanRow("cp_plan (attention)", (how,))]
        skipped = (f", unseen tiles skipped, cut ones computed in blocks of {self.block_size} query rows"
                   if self.mode != "ulysses" else "")
        if self.sliding_layers:
            rows.append(PlanRow("cp_plan (sliding window)", (f"layers {list(self.sliding_layers)}: masked by their "
                                                             "window" + skipped,), kind="sliding"))
        if self.chunked_layers:
            rows.append(PlanRow("cp_plan (chunked)", (f"layers {list(self.chunked_layers)}: masked by their "
                                                      "chunks" + skipped,), kind="chunked"))
        full = [spec.index for spec in self.layers if spec.window is None and spec.chunk is None]
        if full:
            rows.append(PlanRow("cp_plan (causal)", (f"layers {full}: " + ("all-to-all to head shards"
                                                                           if self.mode == "ulysses" else
                                                                           "K/V all-gathered" if self.mode ==
                                                                           "kv_allgather" else "K/V around the ring"),),
                                kind="softmax"))
        if any(spec.head_parameters for spec in self.layers):
            how = ("cut to each rank's heads" if self.mode == "ulysses" else
                   "cut to the Ulysses heads, joined once per row" if self.nested else "joined once per row")
            rows.append(PlanRow("cp_plan (per-head tensors)", (how,), kind="per-head parameters"))
        if self.indexers:
            rows.append(PlanRow("cp_plan (sparse)", (f"indexers of {len(self.indexers)} layers score each rank's "
                                                     "queries against every rank's keys; the picks gathered",),
                                kind="sparse"))
        if self.compressors:
            rows.append(PlanRow("cp_plan (compressed)", (f"compressors of {len(self.compressors)} layers run on the "
                                                         "gathered sequence; their entries join every rank's keys",),
                                kind="compressed"))
        if self.linear_layers:
            first = self.linear_layers[0]
            more = f" (and {len(self.linear_layers) - 1} more)" if len(self.linear_layers) > 1 else ""
            rows.append(PlanRow("cp_plan (linear attention)", (f"Ulysses on {first.name}{more}: {first.form.form}",),
                                kind="linear"))
        if self.inputs != InputNames():
            rows.append(PlanRow("cp_plan (inputs)", (f"splits '{self.inputs.tokens}', passes each rank's "
                                                     f"positions as '{self.inputs.positions}'",)))
        return tuple(rows)

    def estimate(self, memory: MemoryModel) -> None:
        memory.tokens //= self.size  # each rank holds 1/cp of the sequence outside attention


def layer_specs(facts: ModelFacts) -> tuple[LayerSpec, ...]:
    """The model facts' softmax attentions (full, sliding and chunked), each with its mask's
    window or chunk and its per-head parameters."""
    return tuple(LayerSpec(layer.name, layer.index, layer.window, layer.chunk,
                           tuple(p.parameter for p in facts.head_parameters_of(layer.name)), layer.query_scale)
                 for layer in facts.attention_layers
                 if layer.kind in ("softmax", "sliding", "chunked", "sparse", "compressed"))


def _check_ring_can_compute(config: Any, mode: str) -> None:
    """The ring computes attention itself (``ring_math``): plain softmax attention with a
    causal, padding and document mask, a sliding window and attention sinks. What else the
    model's own attention would add, it refuses here, before anything is sent."""
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ConfigError("cp_plan.mode", mode, "set the model's attention_dropout to 0, or use mode 'ulysses'",
                          reason=f"ring attention has no dropout (attention_dropout={dropout})")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ConfigError("cp_plan.mode", mode, "use mode 'ulysses' for this model",
                          reason=f"ring attention does not soft-cap its logits (attn_logit_softcapping={softcap})")


# The kinds context parallel cannot compute in some modes: kind -> (the modes it runs in, why not others)
_KIND_MODES = {
    "unknown": ((), "context parallel does not know how to split it"),
    "sparse": (("ulysses", "kv_allgather"), "its indexer picks each query's keys from the whole sequence, which "
                                            "Ulysses and KV all-gather hold (a ring passes one chunk at a time)"),
    "compressed": (("ulysses", "kv_allgather"), "its compressed entries come from the whole sequence, which Ulysses "
                                                "and KV all-gather hold (a ring passes one chunk at a time)"),
}


def refuse_unknown_kinds(facts: ModelFacts, mode: str) -> None:
    """A layer whose kind context parallel cannot compute (in this mode) is refused by name
    before anything is sent: cut to a chunk, it would silently see only that chunk."""
    for layer in facts.attention_layers:
        modes, why = _KIND_MODES.get(layer.kind, (None, ""))
        if modes is None or mode in modes:
            continue
        reason = f"{layer.name} is a {layer.declared or layer.kind} layer: {why}"
        if modes:
            raise ConfigError("cp_plan.mode", mode, f"use cp_plan.mode: {modes[0]} for this model", reason=reason)
        raise ConfigError("context_parallel_size", ">1", "use context_parallel_size=1, or state the layer's kind in a "
                          "family (fsdp_turbo.core.families.register_family)", reason=reason)


def check_head_split(facts: ModelFacts, cp: int, tp: int, plan: CPPlanConfig) -> None:
    """The attention heads split over tensor parallel and over the Ulysses ranks of context
    parallel (a ring keeps them all); their product must divide the query heads."""
    ulysses, field = {"ulysses": (cp, "tensor_parallel_size*context_parallel_size"),
                      "ring": (1, "tensor_parallel_size"),
                      "hybrid": (plan.ulysses_size or 1, "tensor_parallel_size*cp_plan.ulysses_size"),
                      "kv_allgather": (plan.ulysses_size or 1, "tensor_parallel_size*cp_plan.ulysses_size")}[plan.mode]
    heads, split = facts.num_attention_heads, tp * ulysses
    if heads is not None and split > 1 and heads % split:
        ring = ", or cp_plan.mode='ring'" if plan.mode != "ring" else ""
        raise ConfigError(field, split, f"use sizes whose product divides num_attention_heads={heads}{ring}",
                          reason=f"the model has {heads} attention heads ({facts.num_key_value_heads} key/value heads)")


def resolve_cp_target(model: nn.Module, plan: CPPlanConfig | None, facts: ModelFacts) -> CPTarget:
    """The core attention of the model facts, checked for what CP can wrap. Raises
    ``ConfigError`` (the same on every rank); never communicates."""
    attention = facts.attention
    if attention.kind == "modules":
        return CPTarget(module_names=attention.module_names)
    if attention.kind == "function":
        return CPTarget(function_path=attention.function_path,
                        function=import_attention_function(attention.function_path))
    config = getattr(model, "config", None)
    implementation = attention.hf_implementation
    if implementation is None:
        raise ConfigError("model_facts.attention_function", None,
                          "give model_facts.attention_function='package.module.core_attention' (or "
                          "model_facts.attention_modules)",
                          reason=f"{type(model).__name__} has no recognisable attention (no HF attn_implementation)")
    mode = plan.mode if plan is not None else "ulysses"
    if implementation not in HF_IMPLEMENTATIONS:
        # Each field with its own value: the ring's mode, else the model's attention.
        field_value = ("cp_plan.mode", mode) if mode != "ulysses" else ("model.config._attn_implementation",
                                                                       implementation)
        raise ConfigError(*field_value,
                          f"load the model with attn_implementation in {list(HF_IMPLEMENTATIONS)}",
                          reason=f"{'Ulysses' if mode == 'ulysses' else 'ring attention'} cannot take the place "
                                 f"of the {implementation!r} attention")
    if mode != "ulysses":
        _check_ring_can_compute(config, mode)
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError("model", type(model).__name__, "use a decoder-only model with context parallel",
                          reason="encoder-decoder models are not supported")
    return CPTarget(hf_implementation=implementation)
