"""``patch_model_members``: swap a member of every instance of a class inside a model (the upstream
module API serves it as ``fsdp_turbo.utils.patch``).

Clients use it to put an op of the registry (a kernel) in place of a model's own method,
for example a Qwen3-Next module's gated delta rule, without editing the model's source::

    count = patch_model_members(model, "transformers.models.x.modeling_x.XAttention.forward", fast_forward)

What is replaced, and how, follows the member's kind on the class:

* a plain method: the replacement is bound to each matching module (``self`` is the module)
  and set on that instance, so other models of the same class are untouched;
* a classmethod: bound to the class, set on each instance;
* a staticmethod or a callable attribute: set on each instance as it is;
* a property: its getter is replaced on the class that defines it, setter and deleter kept
  (a property lives on the class, so every instance of that class sees the new getter).

Patching twice with the same replacement changes nothing the second time. The return value
counts the matching modules, over all target / replacement pairs.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from fsdp_turbo.core.errors import ConfigError

__all__ = ["class_and_member", "patch_instance", "patch_model_members", "resolve_callable"]

_REPLACEMENT = "_fsdp_turbo_replaced_by"  # on an installed member: the function it came from


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, str) or callable(value):
        return [value]
    return list(value)


def _import(path: str, field: str) -> Any:
    """The object a dotted path names, importing the longest module prefix that exists."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(owner, attribute):
                raise ConfigError(field, path, "give a dotted path to an existing object",
                                  reason=f"{type(owner).__name__} {owner!r} has no {attribute!r}")
            owner = getattr(owner, attribute)
        return owner
    raise ConfigError(field, path, "give a dotted path whose first part is an importable module")


def resolve_callable(value: Callable[..., Any] | str, field: str = "replacements") -> Callable[..., Any]:
    """``value`` if it is callable, else the callable its dotted path names."""
    if callable(value):
        return value
    if not isinstance(value, str) or "." not in value or ":" in value:
        raise ConfigError(field, value, "give a callable or a dotted path such as 'pkg.module.function'")
    found = _import(value, field)
    if not callable(found):
        raise ConfigError(field, value, "point it at a callable", reason=f"it is a {type(found).__name__}")
    return found


def class_and_member(target: str) -> tuple[type, str]:
    """The class and member name ``package.module.Class.member`` names."""
    class_path, _, member = target.rpartition(".")
    if not class_path or "." not in class_path:
        raise ConfigError("targets", target, "give 'package.module.Class.member'")
    cls = _import(class_path, "targets")
    if not isinstance(cls, type):
        raise ConfigError("targets", target, "name a class before the member", reason=f"{class_path} is not a class")
    return cls, member


def _already(installed: Any, replacement: Callable[..., Any]) -> bool:
    return getattr(installed, _REPLACEMENT, None) is replacement


def _patch_property(cls: type, member: str, descriptor: property, replacement: Callable[..., Any]) -> None:
    if _already(descriptor.fget, replacement):
        return
    if descriptor.fget is None:
        raise ConfigError("targets", f"{cls.__name__}.{member}", "patch a property that can be read")
    owner = next(base for base in cls.__mro__ if member in vars(base))

    def getter(module: Any) -> Any:
        return replacement(module)

    setattr(getter, _REPLACEMENT, replacement)
    setattr(owner, member, property(getter, descriptor.fset, descriptor.fdel, descriptor.__doc__))


def patch_instance(module: nn.Module, member: str, replacement: Callable[..., Any], target: str) -> None:
    """Replace ``member`` on one module (``target`` names it in errors), by the rules above."""
    descriptor = inspect.getattr_static(module, member, None)
    if descriptor is None:
        raise ConfigError("targets", target, "name a member the class has",
                          reason=f"{type(module).__name__} has no {member!r}")
    if isinstance(descriptor, property):
        _patch_property(type(module), member, descriptor, replacement)
        return
    current = getattr(module, member)
    if _already(getattr(current, "__func__", current), replacement):  # patched with it already
        return
    if not callable(current):
        raise ConfigError("targets", target, "patch a method, a property or a callable attribute",
                          reason=f"it is a {type(current).__name__}")
    # keep the member's binding: a method bound to the module (or a classmethod bound to its
    # class) gets the replacement bound the same way; a static or plain callable stays unbound
    receiver = getattr(current, "__self__", None)
    bound = receiver is module or (isinstance(receiver, type) and isinstance(module, receiver))
    installed = types.MethodType(replacement, receiver) if bound else replacement
    if hasattr(replacement, "__dict__"):  # a builtin cannot carry the mark: it is then patched again each time
        setattr(replacement, _REPLACEMENT, replacement)
    # a module's __setattr__ would register an nn.Module replacement as a child: go around it
    object.__setattr__(module, member, installed)


def patch_model_members(model: nn.Module, targets: str | Iterable[str],
                        replacements: Callable[..., Any] | str | Iterable[Callable[..., Any] | str]) -> int:
    """Replace member ``Class.member`` of every module of ``model`` that is a ``Class``, for
    each ``"package.module.Class.member"`` of ``targets``; ``replacements`` is one callable
    (or dotted path) for every target, or one per target. Returns how many modules matched."""
    targets, replacements = _as_list(targets), _as_list(replacements)
    if not targets:
        raise ConfigError("targets", targets, "give at least one 'package.module.Class.member'")
    if len(replacements) == 1:
        replacements = replacements * len(targets)
    if len(replacements) != len(targets):
        raise ConfigError("replacements", len(replacements), f"give one replacement, or {len(targets)} (one a target)")
    matched = 0
    for target, replacement in zip(targets, replacements, strict=True):
        cls, member = class_and_member(target)
        function = resolve_callable(replacement)
        for _, module in model.named_modules():
            if isinstance(module, cls):
                patch_instance(module, member, function, target)
                matched += 1
    return matched
