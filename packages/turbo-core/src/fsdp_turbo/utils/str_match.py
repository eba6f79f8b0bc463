"""``module_name_match(pattern, name)``: the upstream helper clients import by this path.

It is the one wildcard matcher of ``fsdp_turbo.core.patterns`` (``*``, ``?``, ``{*}`` for
one numeric segment, ``{a-b}`` for a numeric range; a full match on the qualified name), so
a pattern means the same in a client's code as in an FSDPTurbo plan.
"""

from __future__ import annotations

from fsdp_turbo.core.patterns import compile_pattern

__all__ = ["module_name_match"]


def module_name_match(pattern: str, name: str) -> bool:
    """Whether ``name`` (a module's qualified name) matches ``pattern`` as a whole, e.g.
    ``module_name_match("model.layers.{*}.mlp.experts", "model.layers.3.mlp.experts")``."""
    return compile_pattern(pattern).matches(name)
