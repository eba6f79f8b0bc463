"""Which modules a memory technique wraps: the plan's outermost matches, else the repeated blocks."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_inspect import repeated_blocks
from fsdp_turbo.core.patterns import match_modules


def select_blocks(model: nn.Module, patterns: Sequence[str] | None, *, field: str) -> dict[str, nn.Module]:
    """Modules by qualified name, in model order. Raises ``ConfigError``; never communicates."""
    if patterns is not None:
        return match_modules(model, patterns, field=field, outermost=True)
    blocks = repeated_blocks(model)
    if not blocks:
        raise ConfigError(field, None, f"give {field}=['model.layers.*'] (or your block pattern)",
                          reason="the model has no recognisable repeated blocks to default to")
    return blocks
