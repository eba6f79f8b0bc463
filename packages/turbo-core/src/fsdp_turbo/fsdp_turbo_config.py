"""FSDPTurbo's configuration: flat dataclasses in the seed's field names.

Every field is validated when the object is built; the objects are read-only
afterwards. World-size checks run in ``FSDPTurboConfig.validate(world_size)``,
before any collective. Configs load from a dict, a YAML file or a TOML file.

What each ``*_plan`` field is, and what turns its feature on (the one rule for the
latter lives in ``core.features.FEATURES``). A plan whose feature is off is ignored and
named in one warning on rank 0 (``core.features.FEATURE_FIELDS``), so one config serves
jobs of several sizes:

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
recompute_plan         patterns (or None)       recompute=True; None: the repeated blocks
swap_activation_plan   patterns (or None)       swap_activation=True; None: the repeated blocks
compile_plan           patterns (or None)       compile=True; None: the repeated blocks
quantization_plan      QuantizeConfig (or None) it is given: the plan is the switch
=====================  =======================  ============================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fsdp_turbo.core.choices import check_published_choice
from fsdp_turbo.core.dtypes import parse_dtype
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFactsConfig
from fsdp_turbo.core.parallel_state import ParallelSizes, resolve_parallel_sizes
from fsdp_turbo.core.validation import (
    ConfigSection,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_optional_patterns,
    check_patterns,
    moved_fields,
)

__all__ = [
    "CPPlanConfig",
    "ChunkLossPlanConfig",
    "ConfigError",
    "EPPlanConfig",
    "FSDPPlanConfig",
    "FSDPTurboConfig",
    "QuantizeConfig",
    "TPPlanConfig",
]

SCALE_MODES = ("floor", "rceil")
RECOMPUTE_POLICIES = ("full", "selective")


def _set(obj: Any, name: str, value: Any) -> None:
    # Frozen dataclasses normalise their own fields once, in __post_init__.
    object.__setattr__(obj, name, value)


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
    """

    _prefix: ClassVar[str] = "fsdp_plan"

    apply_modules: tuple[str, ...] | None = None
    ignored_modules: tuple[str, ...] = ()
    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    output_dtype: torch.dtype | str | None = None
    cast_forward_inputs: bool = True
    reshard_after_forward: bool | int | None = None
    keep_after_forward: tuple[str, ...] = ()
    unit_groups: tuple[tuple[str, ...], ...] = ()
    num_to_forward_prefetch: int = 0
    num_to_backward_prefetch: int = 0
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        p = self._prefix
        _set(self, "apply_modules", check_optional_patterns(self.apply_modules, f"{p}.apply_modules"))
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
    rowwise_parallel: tuple[str, ...] = ()
    sequence_parallel: tuple[str, ...] = ()
    loss_parallel: bool = False

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


@dataclass(frozen=True)
class EPPlanConfig(ConfigSection):
    """Expert-parallel plan: which expert containers to shard, and how tokens reach them."""

    _prefix: ClassVar[str] = "ep_plan"

    apply_modules: tuple[str, ...] | None = None
    dispatcher: str = "fused"
    num_chunks: int = 2

    def __post_init__(self) -> None:
        _set(self, "apply_modules", check_optional_patterns(self.apply_modules, "ep_plan.apply_modules"))
        _set(self, "dispatcher", check_published_choice(self.dispatcher, "ep_plan.dispatcher"))
        check_int(self.num_chunks, "ep_plan.num_chunks", minimum=1)


@moved_fields({name: f"model_facts.{name}"
               for name in ("attention_function", "attention_modules", "token_input", "position_input")})
@dataclass(frozen=True)
class CPPlanConfig(ConfigSection):
    """Context parallel. ``mode``: ``ulysses`` (all-to-all to head shards: bounded by the
    head count), ``ring`` (K/V chunks travel around all ``context_parallel_size`` ranks;
    any head count) or ``hybrid`` (Ulysses over ``ulysses_size`` ranks inside a ring).
    ``load_balance``: ring chunks in zig-zag order, so every rank does the same causal work.

    The core attention it wraps and the forward arguments it splits are model facts
    (``model_facts.attention_function`` / ``attention_modules`` / ``token_input`` /
    ``position_input``). Ulysses runs that attention on the whole sequence for a head
    shard; ring and hybrid replace it by causal softmax attention (``scale`` and
    ``enable_gqa`` honoured; a mask, dropout or ``is_causal=False`` is refused at the call)."""

    _prefix: ClassVar[str] = "cp_plan"

    mode: str = "ulysses"
    ulysses_size: int | None = None
    load_balance: bool = True

    def __post_init__(self) -> None:
        _set(self, "mode", check_choice(self.mode, "cp_plan.mode", ("ulysses", "ring", "hybrid")))
        check_bool(self.load_balance, "cp_plan.load_balance")
        if self.ulysses_size is not None:
            check_int(self.ulysses_size, "cp_plan.ulysses_size", minimum=1)
        if (self.mode == "hybrid") != (self.ulysses_size is not None):
            raise ConfigError("cp_plan.ulysses_size", self.ulysses_size,
                              "give ulysses_size with mode 'hybrid' (and only then)",
                              reason=f"mode is {self.mode!r}")
        if self.ulysses_size is not None and self.ulysses_size < 2:
            raise ConfigError("cp_plan.ulysses_size", self.ulysses_size, "use at least 2 (1 is mode 'ring')")


@moved_fields({"head_module": "model_facts.head_module", "ignore_index": "model_facts.ignore_index"})
@dataclass(frozen=True)
class ChunkLossPlanConfig(ConfigSection):
    """Chunked cross-entropy: the full [tokens, vocab] logits are never built. The head it
    replaces and the label it ignores are model facts (``model_facts.head_module``,
    ``model_facts.ignore_index``)."""

    _prefix: ClassVar[str] = "chunk_loss_plan"

    chunk_size: int = 1024
    z_loss_weight: float = 0.0
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        check_int(self.chunk_size, "chunk_loss_plan.chunk_size", minimum=1)
        _set(self, "z_loss_weight", check_float(self.z_loss_weight, "chunk_loss_plan.z_loss_weight", minimum=0.0))
        if self.logit_softcap is not None:
            _set(self, "logit_softcap",
                 check_float(self.logit_softcap, "chunk_loss_plan.logit_softcap", minimum=0.0, strict=True))


@moved_fields({"head_module": "model_facts.head_module"})
@dataclass(frozen=True)
class QuantizeConfig(ConfigSection):
    """MX block quantization for training, applied by converters picked by pattern. The
    default plan leaves the model facts' output head (``model_facts.head_module``) in high
    precision."""

    _prefix: ClassVar[str] = "quantization_plan"

    quant_format: str = "E4M3"
    block_size: int = 32
    scale_mode: str = "floor"
    apply_modules: tuple[str, ...] | None = None
    ignored_modules: tuple[str, ...] = ()
    converters: tuple[str, ...] | None = None
    emax_elem: int | None = None

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
        "quantization_plan": QuantizeConfig,
        "model_facts": ModelFactsConfig,
    }

    model_facts: ModelFactsConfig = field(default_factory=ModelFactsConfig)
    data_parallel_size: int = 1
    fully_shard_parallel_size: int = -1
    fsdp_plan: FSDPPlanConfig = field(default_factory=FSDPPlanConfig)
    tensor_parallel_size: int = 1
    tp_plan: TPPlanConfig | None = None
    expert_parallel_size: int = 1
    expert_fully_shard_parallel_size: int | None = None
    ep_plan: EPPlanConfig | None = None
    context_parallel_size: int = 1
    cp_plan: CPPlanConfig | None = None
    recompute: bool = False
    recompute_plan: tuple[str, ...] | None = None
    recompute_policy: str | tuple[str, ...] = "full"
    chunk_loss: bool = False
    chunk_loss_plan: ChunkLossPlanConfig = field(default_factory=ChunkLossPlanConfig)
    swap_activation: bool = False
    swap_activation_plan: tuple[str, ...] | None = None
    swap_optimizer: bool = False
    swap_force: bool = False
    quantization_plan: QuantizeConfig | None = None
    compile: bool = False
    compile_plan: tuple[str, ...] | None = None
    compile_backend: str = "inductor"
    device_type: str | None = None

    def __post_init__(self) -> None:
        check_int(self.data_parallel_size, "data_parallel_size", minimum=1)
        check_int(self.fully_shard_parallel_size, "fully_shard_parallel_size", minimum=1, allow=(-1,))
        check_int(self.tensor_parallel_size, "tensor_parallel_size", minimum=1)
        check_int(self.expert_parallel_size, "expert_parallel_size", minimum=1)
        check_int(self.context_parallel_size, "context_parallel_size", minimum=1)
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
        if self.device_type is not None:
            _set(self, "device_type", check_choice(self.device_type, "device_type", ("cpu", "cuda", "npu")))

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
        for flag in ("chunk_loss", "swap_optimizer", "swap_force"):
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
        )
