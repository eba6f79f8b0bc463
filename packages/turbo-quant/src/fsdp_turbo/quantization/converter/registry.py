"""Named converters: each recognises one kind of module and converts it in place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fsdp_turbo.quantization.training.recipe import MXRecipe


@dataclass(frozen=True)
class Converter:
    """``handles(module)``: is it this converter's kind. ``unsupported(module, recipe)``: why it
    cannot be converted (e.g. dims that do not divide the block), else None. ``convert`` works in place."""

    name: str
    handles: Callable[[nn.Module], bool]
    unsupported: Callable[[nn.Module, MXRecipe], str | None]
    convert: Callable[[nn.Module, MXRecipe], None]


_converters: dict[str, Converter] = {}


def register_converter(converter: Converter, *, override: bool = False) -> Converter:
    if converter.name in _converters and not override and _converters[converter.name] is not converter:
        raise ValueError(f"converter {converter.name!r} already exists; pass override=True to replace it")
    _converters[converter.name] = converter
    return converter


def unregister_converter(name: str) -> None:
    _converters.pop(name, None)


def converter_names() -> tuple[str, ...]:
    return tuple(_converters)


def get_converter(name: str) -> Converter | None:
    return _converters.get(name)
