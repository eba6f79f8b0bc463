"""The facade's ``swap_activation`` transform: an ``ActivationSwapper`` on the planned blocks."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.device import has_streams
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.model_inspect import select_blocks
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.recompute.apply import is_recomputed
from fsdp_turbo.memory.swap_activation.swapper import ActivationSwapper

_log = get_logger(__name__)

SWAPPER_ATTR = "fsdp_turbo_activation_swapper"


def _recomputed_here_or_above(model: nn.Module, name: str) -> bool:
    # An enclosing checkpoint re-runs this block in backward; its hooks must see every tensor.
    parts = name.split(".") if name else []
    return any(is_recomputed(model.get_submodule(".".join(parts[:depth]))) for depth in range(len(parts) + 1))


class SwapActivationTransform(Transform):
    """Swap the saved activations of ``swap_activation_plan`` (default: the repeated blocks).

    Runs after recompute (blocks it checkpoints are skipped) and before ``fully_shard``,
    whose pre-forward all-gather runs first anyway (FSDP2 prepends it).
    """

    name = "swap_activation"
    stage = Stage.SWAP_ACTIVATION

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        return config.swap_activation

    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None:
        select_blocks(model, config.swap_activation_plan, field="swap_activation_plan")

    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module:
        device_type = parallel_state.device_type
        if not has_streams(device_type) and not config.swap_activation_force:
            _log.info(f"swap_activation: no-op on {device_type!r}; set swap_activation_force=True to run it anyway")
            return model
        blocks = select_blocks(model, config.swap_activation_plan, field="swap_activation_plan")
        recomputed = [name for name in blocks if _recomputed_here_or_above(model, name)]
        if recomputed:
            _log.info(f"swap_activation: skipping {len(recomputed)} recomputed block(s) {recomputed}; "
                      "recompute already frees their activations")
        kept = [name for name in blocks if name not in recomputed]
        if not kept:
            return model
        swapper = ActivationSwapper([blocks[name] for name in kept], device_type=device_type,
                                    force=config.swap_activation_force).attach()
        setattr(model, SWAPPER_ATTR, swapper)
        _log.info(f"swap_activation: {len(kept)} block(s) on {device_type!r}, first {kept[0]!r}")
        return model
