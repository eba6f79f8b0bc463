"""FSDP2 policies from an ``FSDPPlanConfig``: shared by the dense units (the facade's
transform) and the expert units (the facade's and the module API's expert FSDP)."""

from __future__ import annotations

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_turbo.core.device import has_streams
from fsdp_turbo.fsdp_turbo_config import FSDPPlanConfig


def mixed_precision_policy(plan: FSDPPlanConfig, *, root: bool) -> MixedPrecisionPolicy:
    # output_dtype is the dtype of the model's outputs: casting every unit's output would
    # hand fp32 activations to the next bf16 unit, so only the root casts.
    return MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                                output_dtype=plan.output_dtype if root else None,
                                cast_forward_inputs=plan.cast_forward_inputs)


def reshard_after_forward(plan: FSDPPlanConfig, *, root: bool) -> bool | int:
    # Unset means FSDP2's own heuristic, spelled out so every torch>=2.9 behaves alike:
    # units free their parameters after forward; the root keeps them for backward.
    if plan.reshard_after_forward is None:
        return not root
    return plan.reshard_after_forward


def offload_policy(plan: FSDPPlanConfig, device_type: str) -> OffloadPolicy:
    # Pinned host memory only helps where copies can run asynchronously.
    return CPUOffloadPolicy(pin_memory=has_streams(device_type)) if plan.cpu_offload else OffloadPolicy()
