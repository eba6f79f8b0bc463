"""QLoRA-MX: frozen weights stored, and all-gathered by FSDP, in their MX format (Linears and
fused MoE experts)."""

from fsdp_turbo.quantization.frozen.mx_frozen_experts import (
    FROZEN_EXPERTS_OP,
    MXFrozenExperts,
    MXPackedLastDim,
    frozen_experts_grouped,
    to_mx_frozen_experts,
)
from fsdp_turbo.quantization.frozen.mx_frozen_linear import (
    MXFrozenLinear,
    MXPackedRows,
    frozen_weight_values,
    pack_mx,
    packed_width,
    quantize_frozen_weight,
    to_mx_frozen_linear,
    unpack_mx,
)

__all__ = ["FROZEN_EXPERTS_OP", "MXFrozenExperts", "MXFrozenLinear", "MXPackedLastDim", "MXPackedRows",
           "frozen_experts_grouped", "frozen_weight_values", "pack_mx", "packed_width", "quantize_frozen_weight",
           "to_mx_frozen_experts", "to_mx_frozen_linear", "unpack_mx"]
