"""The chunked-loss transform: HF causal LMs compute their labelled loss chunk by chunk."""

from __future__ import annotations

from torch import nn

from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.plugin import Stage, Transform
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
from fsdp_turbo.memory.chunk_loss.hf_head import check_causal_lm, install_chunked_loss, resolve_head

_log = get_logger(__name__)


class ChunkLossTransform(Transform):
    # After tensor parallel (the head may be vocab-sharded), before FSDP (which wraps the head's class).
    name = "chunk_loss"
    stage = Stage.CHUNK_LOSS

    def is_enabled(self, config: FSDPTurboConfig, parallel_state: ParallelState) -> bool:
        return config.chunk_loss

    def validate(self, config: FSDPTurboConfig, model: nn.Module, parallel_state: ParallelState) -> None:
        check_causal_lm(model)
        resolve_head(model, config.chunk_loss_plan.head_module)

    def apply(self, model: nn.Module, config: FSDPTurboConfig, parallel_state: ParallelState) -> nn.Module:
        plan = config.chunk_loss_plan
        handle = install_chunked_loss(model, head_module=plan.head_module, chunk_size=plan.chunk_size,
                                      ignore_index=plan.ignore_index, z_loss_weight=plan.z_loss_weight,
                                      logit_softcap=plan.logit_softcap)
        _log.info(f"chunk_loss: {type(handle.head).__name__} in chunks of {plan.chunk_size} tokens")
        return model
