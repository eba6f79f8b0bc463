"""The one wildcard matcher for module names, shared by every feature.

Semantics (full match on the module's qualified name):

* ``*`` matches any run of characters, dots included (``*.q_proj``).
* ``?`` matches exactly one character.
* ``{*}`` matches one numeric path segment (``model.layers.{*}``).
* ``{a-b}`` matches one numeric segment in the inclusive range a..b.

Block-wrapping features (FSDP units, recompute, swap) take only the outermost
matches, so ``model.layers.*`` wraps each decoder layer once, not its children.

Patterns see through PEFT, so one config serves full fine-tuning and LoRA. A module also
matches by the name it has in the wrapped model (:func:`wrapped_name`): a PEFT model's
``base_model.model.`` prefix is dropped, and so is each ``base_layer`` segment. The tuner
layer PEFT puts in a module's place (a LoRA ``Linear`` holding ``base_layer``, ``lora_A``
and ``lora_B``) therefore answers to the module's own name (``*.q_proj``), and its
``base_layer`` is not picked apart from it. Full names match too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.stage_part import HeldElsewhere, is_stage_part

_TOKEN = re.compile(r"\{\*\}|\{(\d+)-(\d+)\}|\*|\?")


@dataclass(frozen=True)
class ModulePattern:
    """A compiled wildcard pattern."""

    text: str
    regex: re.Pattern[str]
    ranges: tuple[tuple[int, int], ...]

    def matches(self, name: str) -> bool:
        found = self.regex.fullmatch(name)
        if found is None:
            return False
        for (low, high), group in zip(self.ranges, _range_groups(found, len(self.ranges)), strict=True):
            if not low <= int(group) <= high:
                return False
        return True


def _range_groups(found: re.Match[str], count: int) -> list[str]:
    return [found.group(f"r{i}") for i in range(count)]


@lru_cache(maxsize=1024)
def compile_pattern(text: str) -> ModulePattern:
    """Compile ``text``; raises ``ValueError`` for malformed patterns."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"a module pattern must be a non-empty string, got {text!r}")
    parts: list[str] = []
    ranges: list[tuple[int, int]] = []
    position = 0
    for token in _TOKEN.finditer(text):
        parts.append(_literal(text, text[position : token.start()]))
        lexeme = token.group(0)
        if lexeme == "{*}":
            parts.append(r"\d+")
        elif lexeme == "*":
            parts.append(".*")
        elif lexeme == "?":
            parts.append(".")
        else:
            low, high = int(token.group(1)), int(token.group(2))
            if low > high:
                raise ValueError(f"pattern {text!r}: empty range {{{low}-{high}}}")
            parts.append(f"(?P<r{len(ranges)}>\\d+)")
            ranges.append((low, high))
        position = token.end()
    parts.append(_literal(text, text[position:]))
    return ModulePattern(text, re.compile("".join(parts), re.DOTALL), tuple(ranges))


def _literal(text: str, segment: str) -> str:
    if "{" in segment or "}" in segment:
        raise ValueError(f"pattern {text!r}: braces must be {{*}} or {{a-b}}")
    return re.escape(segment)


PEFT_PREFIX = "base_model.model."  # PeftModel -> its LoraModel (or other tuner) -> the user's model
TUNER_SEGMENT = "base_layer"  # the wrapped module inside a PEFT tuner layer


def is_peft_model(model: nn.Module) -> bool:
    # PEFT's PeftModel, recognised by shape so that turbo-core never imports peft.
    return hasattr(model, "peft_config") and isinstance(getattr(model, "base_model", None), nn.Module)


def wrapped_name(name: str, peft: bool) -> str | None:
    """The name patterns also see for module ``name``: without the PEFT prefix (when ``peft``)
    and without ``base_layer`` segments. ``None`` for a module that has no name of its own
    there: PEFT's own wrappers, and a tuner layer's ``base_layer`` (its layer stands for it)."""
    if peft:
        if not name.startswith(PEFT_PREFIX):
            return None
        name = name[len(PEFT_PREFIX):]
    parts = name.split(".")
    if parts[-1] == TUNER_SEGMENT:
        return None
    return ".".join(part for part in parts if part != TUNER_SEGMENT)


def base_model_name(name: str) -> str:
    """A PEFT model's tensor or module name as the base model has it: without the PEFT prefix
    and the ``base_layer`` segments (checkpoint keys, per-tensor seeds)."""
    return ".".join(part for part in name.removeprefix(PEFT_PREFIX).split(".") if part != TUNER_SEGMENT)


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    return any(compile_pattern(p).matches(name) for p in patterns)


def _compile_field(patterns: Sequence[str], field: str) -> list[ModulePattern]:
    compiled = []
    for text in patterns:
        try:
            compiled.append(compile_pattern(text))
        except ValueError as error:
            raise ConfigError(field, text, "use *, ?, {*} or {a-b} wildcards", reason=str(error)) from None
    return compiled


def match_modules(
    model: nn.Module,
    patterns: Sequence[str],
    *,
    field: str,
    outermost: bool = False,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> dict[str, nn.Module]:
    """Return the modules (by qualified name, in model order) that ``patterns`` pick.

    Every pattern must pick at least one module, or a ``ConfigError`` names it; except on a
    pipeline stage's part (:mod:`fsdp_turbo.core.stage_part`), whose whole model was matched
    first, and whose stand-ins for other stages' modules are never picked.
    ``outermost`` drops matches nested inside another match.
    ``module_filter`` restricts which modules count as candidates.
    """
    compiled = _compile_field(patterns, field)
    hits: dict[str, nn.Module] = {}
    used = [False] * len(compiled)
    peft = is_peft_model(model)
    for name, module in model.named_modules(remove_duplicate=False):
        if not name or isinstance(module, HeldElsewhere) or (module_filter is not None
                                                             and not module_filter(name, module)):
            continue
        seen = wrapped_name(name, peft)
        for index, pattern in enumerate(compiled):
            if pattern.matches(name) or (seen and seen != name and pattern.matches(seen)):
                used[index] = True
                hits.setdefault(name, module)
    for pattern, was_used in zip(compiled, used, strict=True):
        if not was_used and not is_stage_part(model):
            raise ConfigError(
                field,
                pattern.text,
                "check the module names with model.named_modules(); patterns match the full qualified name",
                reason="the pattern matches no module",
            )
    if outermost:
        hits = outermost_only(hits)
    return hits


def outermost_only(hits: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """Drop every name that lies inside another name of ``hits``."""
    kept: dict[str, nn.Module] = {}
    for name in sorted(hits, key=lambda n: n.count(".")):
        if not any(name.startswith(parent + ".") for parent in kept):
            kept[name] = hits[name]
    order = list(hits)
    return {name: kept[name] for name in order if name in kept}


def check_disjoint(claims: Mapping[str, Iterable[str]]) -> None:
    """Raise ``ConfigError`` when a module name is claimed by two plans.

    ``claims`` maps a plan's field name to the module names it picked.
    """
    owner: dict[str, str] = {}
    for field, names in claims.items():
        for name in names:
            if name in owner and owner[name] != field:
                raise ConfigError(
                    field,
                    name,
                    f"remove {name!r} from one of {owner[name]} and {field}",
                    reason=f"the module is already claimed by {owner[name]}",
                )
            owner[name] = field
