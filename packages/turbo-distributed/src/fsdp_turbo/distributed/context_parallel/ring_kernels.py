"""The ring's two block kernels, through the op registry: ``cp.ring_block_forward`` gives
a block's (output, lse), ``cp.ring_block_backward`` its (dQ, dK, dV) from the final output
and lse. ``causal``: the tile is a diagonal one (the same positions on both sides), so the
kernel can skip its upper half instead of reading a mask.

The portable kernels are ``ring_math``'s, which build the block's score matrix. On CPU,
torch's flash-attention op for CPU (``_scaled_dot_product_flash_attention_for_cpu`` and
its backward, which return and take the log-sum-exp) computes the same numbers without
that matrix. It wants an additive mask of the query's dtype, and it reports ``lse = 0``
for a query row that sees no key of the block: such rows are set to ``-inf`` (and their
output to 0) here, so the merge ignores them.
"""

from __future__ import annotations

import torch

from fsdp_turbo.core.ops import register_op
from fsdp_turbo.distributed.context_parallel.ring_math import block_attention, block_grads

FORWARD = "cp.ring_block_forward"
BACKWARD = "cp.ring_block_backward"

def _causal(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]


@register_op(FORWARD)
def portable_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                     causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return block_attention(q, k, v, scale, _causal(q, k) if causal else mask)


@register_op(BACKWARD)
def portable_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                      out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, causal: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return block_grads(q, k, v, scale, _causal(q, k) if causal else mask, out, lse, grad_out)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


@register_op(FORWARD, "cpu")
def cpu_flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    if mask is not None:
        blind = ~mask.any(-1)  # [B or 1, 1, Sq]: rows that see nothing here
        lse = lse.masked_fill(blind, float("-inf"))
        out = out.masked_fill(blind[..., None], 0.0)
    return out, lse


@register_op(BACKWARD, "cpu")
def cpu_flash_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
                       out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor, causal: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the kernel takes contiguous tensors only (grad_out comes from a transpose)
    grad_out, q, k, v, out, lse = (t.contiguous() for t in (grad_out, q, k, v, out, lse))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
    return grads[0], grads[1], grads[2]
