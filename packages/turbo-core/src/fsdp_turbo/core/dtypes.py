"""Parsing dtypes given as strings in configs ("bfloat16", "bf16", "torch.float32")."""

from __future__ import annotations

import torch

from fsdp_turbo.core.errors import ConfigError

_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def parse_dtype(value: torch.dtype | str | None, field: str) -> torch.dtype | None:
    """Return a floating ``torch.dtype`` for ``value``; ``None`` stays ``None``."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise ConfigError(field, value, "use a floating dtype such as torch.bfloat16")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _ALIASES:
            return _ALIASES[key]
    raise ConfigError(field, value, f"use a torch dtype or one of {sorted(_ALIASES)}")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
