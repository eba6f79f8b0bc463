"""Small field checks shared by the config dataclasses; each raises ConfigError."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fsdp_turbo.core.errors import ConfigError


def check_bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(field, value, "use True or False")
    return value


def check_int(value: Any, field: str, *, minimum: int | None = None, allow: Iterable[int] = ()) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, value, "use an integer")
    if value in tuple(allow):
        return value
    if minimum is not None and value < minimum:
        extra = " or ".join(str(a) for a in allow)
        raise ConfigError(field, value, f"use an integer >= {minimum}" + (f" (or {extra})" if extra else ""))
    return value


def check_float(value: Any, field: str, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, value, "use a number")
    value = float(value)
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        raise ConfigError(field, value, f"use a number {'>' if strict else '>='} {minimum}")
    return value


def check_choice(value: Any, field: str, choices: Iterable[str], *, upper: bool = False) -> str:
    options = tuple(choices)
    if isinstance(value, str):
        key = value.strip().upper() if upper else value.strip().lower()
        if key in options:
            return key
    raise ConfigError(field, value, f"use one of {list(options)}")


def check_patterns(value: Any, field: str) -> tuple[str, ...]:
    """Normalise a pattern list to a tuple of non-empty strings."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(field, value, "use a list of non-empty wildcard strings such as ['model.layers.*']")
    return tuple(value)


def check_optional_patterns(value: Any, field: str) -> tuple[str, ...] | None:
    return None if value is None else check_patterns(value, field)
