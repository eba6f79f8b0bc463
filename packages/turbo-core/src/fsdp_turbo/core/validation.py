"""The config dataclasses' shared base (dicts and files in, dicts out) and the small field
checks they use; everything raises ConfigError. The library config and the ``fsdp-turbo``
job file are both built on it."""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from fsdp_turbo.core.dtypes import dtype_name
from fsdp_turbo.core.errors import ConfigError


class ConfigSection:
    """A config dataclass that loads from a dict, a YAML file or a TOML file.

    Unknown keys, and keys that are not strings, are a ConfigError naming ``<prefix>.<key>``
    and the known fields.
    ``_nested`` maps a field to the section class its mapping value is built into;
    ``_moved`` maps a removed field to where it lives now (see :func:`moved_fields`).
    """

    _nested: ClassVar[dict[str, type[ConfigSection]]] = {}
    _prefix: ClassVar[str] = ""
    _moved: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, *, prefix: str | None = None):
        prefix = cls._prefix if prefix is None else prefix
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(prefix or cls.__name__, data, "use a mapping of field names to values")
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        check_keys(data, prefix, f"use field names (text) as keys; known fields are {sorted(known)}")
        unknown = sorted(set(data) - known - set(cls._moved))  # a moved field: the constructor names its place
        if unknown:
            where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
            raise ConfigError(where, data[unknown[0]], f"remove it; known fields are {sorted(known)}",
                              reason="unknown field")
        kwargs = dict(data)
        for name, nested in cls._nested.items():
            if isinstance(kwargs.get(name), dict):
                kwargs[name] = nested.from_dict(kwargs[name], prefix=nested._prefix or name)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, ConfigSection):
                value = value.to_dict()
            elif isinstance(value, torch.dtype):
                value = dtype_name(value)
            elif isinstance(value, tuple):
                value = [v.to_dict() if isinstance(v, ConfigSection) else v for v in value]
            out[f.name] = value
        return out

    @classmethod
    def from_file(cls, path: str | Path):
        """YAML (safe: no object construction) or TOML."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        elif suffix == ".toml":
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        else:
            raise ConfigError("path", str(path), "use a .yaml, .yml or .toml file")
        return cls.from_dict(data)


def moved_fields(moved: dict[str, str]):
    """Class decorator, outside ``@dataclass``: each field of ``moved`` (old name -> where it
    lives now) was removed, and giving it, to the constructor or in a mapping, is a
    ``ConfigError`` that names its new place instead of an unknown-argument ``TypeError``."""

    def wrap(cls):
        cls._moved = dict(moved)
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):  # noqa: N807 - the dataclass's own __init__, wrapped
            for old in sorted(kwargs.keys() & moved.keys()):
                where = f"{cls._prefix}.{old}" if cls._prefix else old
                raise ConfigError(where, kwargs[old], f"give it as {moved[old]}",
                                  reason=f"{where} was removed; it is {moved[old]} now")
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return cls

    return wrap


def check_sections(value: Any, kind: type[ConfigSection], field_name: str, *, example: str,
                   allow_empty: bool = False) -> tuple:
    """A list of mappings, each built into ``kind`` and named ``field[i]`` in errors."""
    if not isinstance(value, list | tuple) or (not value and not allow_empty):
        raise ConfigError(field_name, value, f"give a list of mappings, e.g. {example}")
    sections = []
    for i, item in enumerate(value):
        try:
            sections.append(item if isinstance(item, kind) else kind.from_dict(item))
        except ConfigError as error:  # the same error, with the entry's index in its field name
            field = error.field.replace(kind._prefix, f"{field_name}[{i}]", 1)
            raise ConfigError(field, error.value, error.fix, reason=error.reason) from None
    return tuple(sections)


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


def check_keys(data: dict, section: str, fix: str) -> None:
    """Every key of ``data`` (the mapping of ``section``; ``""``: the top level) is a string.
    YAML makes ``1:``, ``1.5:``, ``yes:`` and ``~:`` keys an int, a float, a bool and None:
    never field names, and mixed with strings they cannot even be sorted."""
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{section}.{key}" if section else str(key), data[key], fix,
                              reason=f"the key {key!r} is not text but {type(key).__name__}")


def check_float(value: Any, field: str, *, minimum: float | None = None, strict: bool = False,
                maximum: float | None = None) -> float:
    """A finite number in ``[minimum, maximum]`` (``(minimum, maximum]`` when ``strict``).

    NaN and infinity are refused here, for every float field: NaN passes every comparison
    (``nan < 0`` and ``nan > 1`` are both false), and YAML reads ``.nan`` and ``.inf`` as
    numbers, so a bound check alone lets them through to the training run."""
    fix = f"use {_number_range(minimum, strict, maximum)}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, value, fix)
    try:
        number = float(value)
    except OverflowError:
        raise ConfigError(field, value, fix, reason="it is too large for a float") from None
    if not math.isfinite(number):
        raise ConfigError(field, value, fix, reason="NaN and infinity are not usable values")
    too_low = minimum is not None and (number < minimum or (strict and number == minimum))
    if too_low or (maximum is not None and number > maximum):
        raise ConfigError(field, number, fix)
    return number


def _number_range(minimum: float | None, strict: bool, maximum: float | None) -> str:
    """``check_float``'s fix: the accepted range in words."""
    if minimum is not None and maximum is not None:
        return f"a finite number in {'(' if strict else '['}{minimum}, {maximum}]"
    if minimum is not None:
        return f"a finite number {'>' if strict else '>='} {minimum}"
    if maximum is not None:
        return f"a finite number <= {maximum}"
    return "a finite number"


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
