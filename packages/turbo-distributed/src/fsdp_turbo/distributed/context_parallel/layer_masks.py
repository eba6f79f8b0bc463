"""What one attention layer's call needs beside the core attention under context parallel,
from its ``LayerSpec``: its queries' scale by their index in the row, corrected to the global
index (Llama 4's temperature tuning reads the index of a token in the rank's chunk, where one
process reads its index in the whole row)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_turbo.distributed.context_parallel.context import ForwardContext, LayerSpec


def rescale_queries(spec: LayerSpec, module: nn.Module, query: torch.Tensor, context: ForwardContext) -> torch.Tensor:
    """``query [B, H, s, D]`` of this rank's chunk, scaled by the model at the chunk's own
    indices ``0 .. s-1``, as one process scales it: at the tokens' indices in the padded row."""
    if spec.query_scale is None:
        return query
    module = getattr(module, "_module", module)
    mine = context.my_positions.to(query.device)
    local = spec.query_scale(module, torch.arange(query.shape[2], device=query.device))
    whole = spec.query_scale(module, mine)
    return query * (whole / local).to(query.dtype)[None, None, :, None]
