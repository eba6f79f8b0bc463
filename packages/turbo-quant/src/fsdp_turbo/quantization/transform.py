"""The facade's ``quantize`` transform: the first one, so later transforms see MX modules."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.patterns import matches_any
from fsdp_turbo.core.plugin import Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.quantization.converter import convert_model, plan_conversion

_log = get_logger(__name__)


def tensor_parallel_unsuitable(model: nn.Module, config: FSDPTurboConfig) -> dict[str, str]:
    """Linears whose tensor-parallel shard does not hold whole blocks (each rank quantizes its shard)."""
    tp, plan = config.tensor_parallel_size, config.tp_plan
    if tp == 1 or plan is None:
        return {}
    block = config.quantization_plan.block_size
    unsuitable = {}
    for name, module in model.named_modules():
        for patterns, dim, label in ((plan.colwise_parallel, "out_features", "colwise"),
                                     (plan.rowwise_parallel, "in_features", "rowwise")):
            size = getattr(module, dim, None)
            if isinstance(size, int) and matches_any(name, patterns or ()) and (size // tp) % block:
                unsuitable[name] = (f"it is {label} over tp={tp}, so each rank holds {dim}={size // tp}, "
                                    f"not a multiple of block_size={block}")
    return unsuitable


class QuantizeTransform(Transform):
    name = "quantize"
    stage = Stage.QUANTIZE

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        return config.quantization_plan is not None

    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None:
        plan_conversion(model, config.quantization_plan, unsuitable=tensor_parallel_unsuitable(model, config))

    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module:
        converted = convert_model(model, config.quantization_plan,
                                  unsuitable=tensor_parallel_unsuitable(model, config))
        plan = config.quantization_plan
        _log.info(f"quantize: {len(converted)} modules to {plan.quant_format} blocks of {plan.block_size} "
                  f"({plan.scale_mode})")
        return model
