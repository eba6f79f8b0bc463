"""QLoRA-MX: frozen weights stored, and all-gathered by FSDP, in their MX format."""

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

__all__ = ["MXFrozenLinear", "MXPackedRows", "frozen_weight_values", "pack_mx", "packed_width",
           "quantize_frozen_weight", "to_mx_frozen_linear", "unpack_mx"]
