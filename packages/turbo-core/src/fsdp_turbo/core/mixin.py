"""Changing what a module does in place, by mixing a class into its own class.

The module keeps its parameters, names and ``state_dict`` keys, ``isinstance`` against
the user's class still holds, and any later wrapper (FSDP2 swaps the class too)
subclasses the result. Used by quantization converters and expert parallel.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_mixed: dict[tuple[type, type], type] = {}


def mix_in(module: nn.Module, mixin: type, prefix: str, **attributes: Any) -> nn.Module:
    """Make ``module`` an instance of ``(mixin, type(module))`` and set ``attributes`` on it."""
    base = type(module)
    if issubclass(base, mixin):
        raise ValueError(f"{base.__name__} is already {mixin.__name__}")
    if not issubclass(mixin, base):  # a mixin may already derive from the base (MXLinear is an nn.Linear)
        mixin = _mixed.setdefault((mixin, base), type(f"{prefix}{base.__name__}", (mixin, base), {}))
    module.__class__ = mixin
    for name, value in attributes.items():
        setattr(module, name, value)
    return module
