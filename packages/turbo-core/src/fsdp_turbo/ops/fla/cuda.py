"""The CUDA backend: fla's (flash-linear-attention's) own Triton kernels, called as they are.

Imported only on the first call of a "cuda" kernel (turbo-core's ``LazyKernel``), so a
machine without fla or without a GPU never imports it. The one thing this layer adds is
``chunk_size``: clients pass it to the chunk op, fla takes it only in versions whose
function accepts it (as a parameter or through ``**kwargs``); older ones always chunk by 64.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from fsdp_turbo.core.errors import ConfigError

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

FLA_FIXED_CHUNK = 64  # the chunk size of fla versions that take no chunk_size


def _takes_chunk_size(function: Any) -> bool:
    parameters = inspect.signature(function).parameters
    return "chunk_size" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


_FLA_TAKES_CHUNK_SIZE = _takes_chunk_size(_fla_chunk)


def chunk_gated_delta_rule(*args: Any, chunk_size: int = FLA_FIXED_CHUNK,
                           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule``, with ``chunk_size`` passed on where fla takes it."""
    if _FLA_TAKES_CHUNK_SIZE:
        return _fla_chunk(*args, chunk_size=chunk_size, **kwargs)
    if chunk_size != FLA_FIXED_CHUNK:
        raise ConfigError("chunk_size", chunk_size, f"use {FLA_FIXED_CHUNK}, or install a flash-linear-attention "
                          "whose chunk_gated_delta_rule takes chunk_size", reason="the installed fla has no chunk_size")
    return _fla_chunk(*args, **kwargs)
