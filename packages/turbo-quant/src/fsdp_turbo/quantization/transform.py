"""The facade's ``quantize`` transform: the first one, so later transforms see MX modules."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.memory_estimate import MemoryModel
from fsdp_turbo.core.model_facts import ModelFacts
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import FeaturePlan, PlanRow, Plans, SplitsParameters, Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.quantization.converter import Conversion, apply_conversions, plan_conversion
from fsdp_turbo.quantization.gather_plan import GatheredWeight, Sharding, apply_gathers, plan_gathers
from fsdp_turbo.quantization.training.recipe import MXRecipe

_log = get_logger(__name__)
FROZEN_PREFIX = "mx_frozen_"  # the converters that store frozen weights (store_frozen_weights)


@dataclass(frozen=True)
class QuantizePlan(FeaturePlan):
    conversions: tuple[Conversion, ...]
    recipe: MXRecipe
    skipped: tuple[tuple[str, str], ...] = ()  # (module, why) a converter handles but leaves out
    gathered: tuple[GatheredWeight, ...] = ()  # low_precision_all_gather: weights FSDP gathers as MX bytes
    gathered_high: tuple[tuple[str, str], ...] = ()  # (module, why) converted, but gathered in high precision
    gather_both: bool = False  # low_precision_all_gather_mode "all": each gather carries both orientations

    def describe(self) -> tuple[PlanRow, ...]:
        rows = [PlanRow("quantization_plan", tuple(f"{c.name} ({c.converter})" for c in self.conversions))]
        rows += _rows_by_reason("quantization_plan (left out: {})", self.skipped)
        if self.gathered:
            mode = "both orientations per gather" if self.gather_both else "one orientation per gather"
            modules = tuple(dict.fromkeys(w.parameter.rpartition(".")[0] for w in self.gathered))
            rows.append(PlanRow(f"quantization_plan.low_precision_all_gather (MX bytes, {mode})", modules))
        rows += _rows_by_reason("quantization_plan.low_precision_all_gather (high precision: {})", self.gathered_high)
        return tuple(rows)

    def estimate(self, memory: MemoryModel) -> None:
        # QLoRA-MX: the frozen weights of a frozen-weight converter's modules are stored as packed
        # MX bytes, one code per element and one E8M0 scale per block. (MX training keeps fp32
        # master weights: no change.)
        frozen = [c.name for c in self.conversions if c.converter.startswith(FROZEN_PREFIX)]
        gathered = {w.parameter for w in self.gathered}
        for name, layout in memory.params.items():
            module = name.rpartition(".")[0]
            if module in frozen and not layout.trainable and len(layout.shape) >= 2:
                layout.bytes_per_element = 1 + 1 / self.recipe.block_size
            if name in gathered:
                layout.gather_bytes_per_element = (1 + 1 / self.recipe.block_size) * (2 if self.gather_both else 1)


def _rows_by_reason(label: str, named: tuple[tuple[str, str], ...]) -> list[PlanRow]:
    by_reason: dict[str, list[str]] = {}
    for name, why in named:
        by_reason.setdefault(why, []).append(name)
    return [PlanRow(label.format(why), tuple(names)) for why, names in by_reason.items()]


def tensor_parallel_unsuitable(model: nn.Module, tp: SplitsParameters, block: int, *,
                               frozen_weights: bool = False) -> dict[str, str]:
    """Linears whose tensor-parallel shard does not hold whole blocks (each rank quantizes its shard).

    With ``frozen_weights`` (``store_frozen_weights``: only frozen Linears convert, to
    ``MXFrozenLinear``) only those are checked, and only ``in_features``: a frozen weight has
    blocks along ``in_features`` alone (no weight-gradient GEMM), so a colwise split of
    ``out_features`` cuts whole rows whatever their number."""
    dims = ("in_features",) if frozen_weights else ("out_features", "in_features")
    unsuitable = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or (frozen_weights and module.weight.requires_grad):
            continue
        whole = (module.out_features, module.in_features)
        local = tp.local_shape(f"{name}.weight", whole)
        split = [f"{dim}={size}" for dim, size, full in zip(("out_features", "in_features"), local, whole, strict=True)
                 if dim in dims and size != full and size % block]
        if split:
            unsuitable[name] = (f"tensor parallel leaves each rank {', '.join(split)}, "
                                f"not a multiple of block_size={block}")
    return unsuitable


class QuantizeTransform(Transform):
    """MX training on the modules the plan's converters pick.

    Receives the tensor-parallel plan: each TP rank quantizes its own shard, so a Linear
    whose shard holds no whole block is left in high precision (named in a rank-0 warning;
    a ConfigError when ``apply_modules`` picks it). Applied before tensor parallel: TP's
    styles then shard the converted modules, ``store_frozen_weights``' packed bytes included
    (whole blocks per rank, so each rank's bytes are the packing of its shard)."""

    name = "quantize"
    stage = Stage.QUANTIZE
    requires = ("tensor_parallel",)

    def plan(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState,
             upstream: Plans, facts: ModelFacts) -> QuantizePlan:
        settings, tp = config.quantization_plan, upstream["tensor_parallel"]
        unsuitable = (tensor_parallel_unsuitable(model, tp, settings.block_size,
                                                 frozen_weights=settings.store_frozen_weights)
                      if tp is not None else {})
        conversions, skipped = plan_conversion(model, settings, facts, unsuitable=unsuitable)
        recipe = MXRecipe.from_config(settings)
        gathered, gathered_high = (), ()
        if settings.low_precision_all_gather:
            # FSDP shards a dense weight over fsdp x cp (the fsdp mesh's shard dim), experts over efsdp
            sharding = Sharding(parallel_state.fsdp_size * parallel_state.cp_size, parallel_state.efsdp_size,
                                parallel_state.sizes.ep)
            gathered, gathered_high = plan_gathers(model, conversions, recipe, sharding, tp)
        return QuantizePlan(tuple(conversions), recipe, tuple(skipped), gathered, gathered_high,
                            settings.low_precision_all_gather_mode == "all")

    def apply(self, model: nn.Module, plan: QuantizePlan, parallel_state: ParallelState) -> nn.Module:
        apply_conversions(model, plan.conversions, plan.recipe)
        recipe = plan.recipe
        _log.info(f"quantize: {len(plan.conversions)} modules to {recipe.quant_format} blocks of {recipe.block_size} "
                  f"({recipe.scale_mode})")
        if plan.skipped:
            _log.warning(f"quantize: left {len(plan.skipped)} module(s) in high precision: "
                         + "; ".join(f"{name} ({why})" for name, why in plan.skipped))
        apply_gathers(model, plan.gathered, recipe, both=plan.gather_both)
        if plan.gathered_high:
            _log.warning(f"quantization_plan.low_precision_all_gather: FSDP gathers {len(plan.gathered_high)} MX "
                         "module(s) in high precision: "
                         + "; ".join(f"{name} ({why})" for name, why in plan.gathered_high))
        return model
