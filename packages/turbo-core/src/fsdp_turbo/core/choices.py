"""Choice lists owned by the feature package that implements them.

A field such as ``quantization_plan.quant_format`` or ``ep_plan.dispatcher`` names a row of
a table in a feature package (turbo-quant's formats, turbo-distributed's dispatchers). That
table is the one list: the package publishes it under the entry-point group
``fsdp_turbo.choices``, keyed by the field, and the config checks a value against it when
the config is built. Where no installed package publishes the field's table, any name
passes here, and the facade then names the package to install for the feature.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from fsdp_turbo.core.errors import ConfigError

ENTRY_POINT_GROUP = "fsdp_turbo.choices"


@cache
def published_choices(field: str) -> tuple[str, ...] | None:
    """The names the installed package's table has for ``field``, or ``None``."""
    point = next((p for p in entry_points(group=ENTRY_POINT_GROUP) if p.name == field), None)
    if point is None:
        return None
    table: Collection[str] = point.load()
    return tuple(table)


def check_published_choice(value: Any, field: str, *, upper: bool = False) -> str:
    """``value`` normalised (stripped; upper or lower case), checked against ``field``'s table."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(field, value, "give the name as text")
    name = value.strip().upper() if upper else value.strip().lower()
    choices = published_choices(field)
    if choices is not None and name not in choices:
        raise ConfigError(field, value, f"use one of {list(choices)}")
    return name
