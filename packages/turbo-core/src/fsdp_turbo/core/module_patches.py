"""Member patches applied to the model before anything is planned: the config's
``module_patches`` (a user's kernels, by pattern) and the families' own (``Family.patches``:
where a family's code does not fit a feature's contract).

A plain method is replaced by mixing a class that defines it into the module's own class
(``core.mixin``, as the features change modules): a feature that later mixes its own class in
(expert parallel, MX training) then still replaces the method. An instance attribute would
hide the feature's method, and the feature would silently not run. Other members (properties,
static and class methods, callable attributes) follow ``fsdp_turbo.utils.patch``, the member
patcher of the upstream module API. Patching twice with the same replacement changes nothing.

A patch changes what the model facts see (an expert container's call, say), so the facade
applies them first, and ``fsdp-turbo plan`` shows the same model ``train`` trains.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.forms import class_names
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.member_patch import class_and_member, patch_instance, resolve_callable
from fsdp_turbo.core.mixin import mix_in
from fsdp_turbo.core.patterns import match_modules
from fsdp_turbo.core.validation import ConfigSection, check_optional_patterns

_log = get_logger(__name__)


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class ModulePatch(ConfigSection):
    """One member replaced on the modules of a class, e.g. a faster forward of a model's linear
    attention: ``{target: transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet.forward,
    replacement: my_kernels.gated_deltanet_forward, modules: ["model.layers.{0-3}.linear_attn"]}``."""

    _prefix: ClassVar[str] = "module_patches[]"

    target: str = ""
    """The member to replace, as ``package.module.Class.member`` (a method, classmethod,
    staticmethod, property or callable attribute). Required."""
    replacement: str = ""
    """A dotted path to the callable put in its place; a method's replacement takes the module
    as ``self``. It must compute what the member computed. Required."""
    modules: tuple[str, ...] | None = None
    """Patterns of the instances to patch (each must pick at least one module of the class).
    Unset: every instance of the class in the model."""

    def __post_init__(self) -> None:
        p = self._prefix
        target = self.target
        if not isinstance(target, str) or target.count(".") < 2 or not all(target.split(".")):
            raise ConfigError(f"{p}.target", target, "give 'package.module.Class.member', e.g. "
                              "'transformers.models.llama.modeling_llama.LlamaAttention.forward'")
        replacement = self.replacement
        if not isinstance(replacement, str) or "." not in replacement or not all(replacement.split(".")):
            raise ConfigError(f"{p}.replacement", replacement, "give a dotted path to a callable, e.g. "
                              "'my_kernels.fast_forward'")
        _set(self, "modules", check_optional_patterns(self.modules, f"{p}.modules"))


_PATCH_CLASSES: dict[tuple[str, Callable[..., Any]], type] = {}


def _patch_member(module: nn.Module, member: str, replacement: Callable[..., Any], target: str) -> None:
    if not isinstance(inspect.getattr_static(module, member, None), types.FunctionType):
        patch_instance(module, member, replacement, target)
        return
    patch = _PATCH_CLASSES.setdefault((member, replacement), type(
        f"Patched_{member}", (), {member: replacement, "__doc__": f"{member} replaced by {replacement.__qualname__}"}))
    if not isinstance(module, patch):
        mix_in(module, patch, "Patched")


def _renamed(error: ConfigError, field: str) -> ConfigError:
    # utils.patch names its arguments ("targets", "replacements"); a config names its fields
    names = {"targets": f"{field}.target", "replacements": f"{field}.replacement"}
    return ConfigError(names.get(error.field, field), error.value, error.fix, reason=error.reason)


def _apply_one(model: nn.Module, patch: ModulePatch, field: str) -> int:
    try:
        cls, member = class_and_member(patch.target)
        replacement = resolve_callable(patch.replacement)
    except ConfigError as error:
        raise _renamed(error, field) from None
    instances = {name: m for name, m in model.named_modules() if name and isinstance(m, cls)}
    if patch.modules is not None:
        picked = match_modules(model, patch.modules, field=f"{field}.modules",
                               module_filter=lambda name, module: isinstance(module, cls))
        instances = {name: m for name, m in instances.items() if name in picked}
    if not instances:
        raise ConfigError(f"{field}.target", patch.target, "point it at a class the model holds, or drop the patch",
                          reason=f"the model holds no {cls.__name__}")
    try:
        for module in instances.values():
            _patch_member(module, member, replacement, patch.target)
    except ConfigError as error:
        raise _renamed(error, field) from None
    return len(instances)


def apply_module_patches(model: nn.Module, patches: Sequence[ModulePatch]) -> None:
    """The families' patches, then the config's, on every instance they name. Raises
    ``ConfigError`` (the same on every rank); never communicates."""
    from fsdp_turbo.core.families import families

    for family in families():
        for known in family.patches:
            modules = [m for _, m in model.named_modules() if known.module_class in class_names(m)]
            for module in modules:
                _patch_member(module, known.member, known.replacement, f"{known.module_class}.{known.member}")
            if modules:
                _log.info(f"{family.name}: {known.module_class}.{known.member} replaced on {len(modules)} modules "
                          f"({known.why})")
    for index, patch in enumerate(patches):
        count = _apply_one(model, patch, f"module_patches[{index}]")
        _log.info(f"module_patches[{index}]: {patch.target} replaced by {patch.replacement} on {count} modules")
