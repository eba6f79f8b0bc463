"""``fsdp_turbo.ops.fla``: the delta-rule ops of linear-attention models (Gated DeltaNet:
Qwen3-Next, Qwen3.5; Kimi Delta Attention: Kimi Linear), in the op registry under fla's names.

Importing this package registers four ops, called as flash-linear-attention's (fla's) functions
and returning ``(o, final_state)``:

* ``chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
  output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64)``;
* ``fused_recurrent_gated_delta_rule(q, k, v, g=None, beta=None, *, ...)`` (no ``chunk_size``);
* ``chunk_kda`` / ``fused_recurrent_kda``: the same with ``g`` one log-decay per key channel
  (``[B, T, HV, K]``), as ``fla.ops.kda``'s.

Each has a portable PyTorch kernel (:mod:`.gated_delta_rule`, every device) and, where fla
can be found, fla's own kernels for "cuda" (:mod:`.cuda`, imported on the first call only).
Clients take the current device's kernel with ``fsdp_turbo.ops.registry.get_op(name)``::

    import fsdp_turbo.ops.fla
    from fsdp_turbo.ops.registry import get_op
    op = functools.partial(get_op("chunk_gated_delta_rule"), chunk_size=64)
"""

from __future__ import annotations

from fsdp_turbo.core.ops import register_lazy_kernels, register_op
from fsdp_turbo.ops.fla.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fsdp_turbo.ops.fla.kda import chunk_kda, fused_recurrent_kda

__all__ = ["BACKENDS", "CHUNK_KDA_OP", "CHUNK_OP", "RECURRENT_KDA_OP", "RECURRENT_OP", "chunk_gated_delta_rule",
           "chunk_kda", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"]

CHUNK_OP = "chunk_gated_delta_rule"
RECURRENT_OP = "fused_recurrent_gated_delta_rule"
CHUNK_KDA_OP = "chunk_kda"
RECURRENT_KDA_OP = "fused_recurrent_kda"

# (op, device type, backend module, attribute, library the module needs)
BACKENDS: tuple[tuple[str, str, str, str, str | None], ...] = (
    (CHUNK_OP, "cuda", f"{__name__}.cuda", "chunk_gated_delta_rule", "fla"),
    (RECURRENT_OP, "cuda", f"{__name__}.cuda", "fused_recurrent_gated_delta_rule", "fla"),
    (CHUNK_KDA_OP, "cuda", f"{__name__}.cuda_kda", "chunk_kda", "fla"),
    (RECURRENT_KDA_OP, "cuda", f"{__name__}.cuda_kda", "fused_recurrent_kda", "fla"),
)

register_op(CHUNK_OP)(chunk_gated_delta_rule)
register_op(RECURRENT_OP)(fused_recurrent_gated_delta_rule)
register_op(CHUNK_KDA_OP)(chunk_kda)
register_op(RECURRENT_KDA_OP)(fused_recurrent_kda)
register_lazy_kernels(BACKENDS)
