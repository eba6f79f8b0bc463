"""The CUDA backend of Kimi Delta Attention: fla's (flash-linear-attention's) ``fla.ops.kda``
Triton kernels, called as they are. Imported only on the first call of a "cuda" KDA kernel,
so a machine without fla (or with an fla that predates KDA) never imports it. The portable
op's ``chunk_size`` (a memory knob of the plain-PyTorch form) does not apply to fla's kernels:
a caller that asks for one gets an error rather than a silently different split."""

from __future__ import annotations

from typing import Any

import torch

from fla.ops.kda import chunk_kda as _fla_chunk_kda
from fla.ops.kda import fused_recurrent_kda
from fsdp_turbo.core.errors import ConfigError

__all__ = ["chunk_kda", "fused_recurrent_kda"]


def chunk_kda(*args: Any, chunk_size: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_kda``; ``chunk_size`` is the portable op's only."""
    if chunk_size is not None:
        raise ConfigError("chunk_size", chunk_size, "leave chunk_size unset on CUDA (fla's KDA kernels chunk by "
                          "themselves)", reason="the portable KDA op's chunk_size does not apply to fla's kernels")
    return _fla_chunk_kda(*args, **kwargs)
