"""Per-device kernel registry with a portable fallback.

Every op has a portable PyTorch implementation (device ``None``) that runs on CPU.
Device kernels register under their device type; callers dispatch by name, and a
missing device kernel falls back to the portable one with a one-time warning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fsdp_turbo.core.logging import get_logger, warn_once

F = TypeVar("F", bound=Callable[..., Any])
PORTABLE = "portable"

_log = get_logger(__name__)
_kernels: dict[str, dict[str, Callable[..., Any]]] = {}


def register_op(name: str, device_type: str | None = None, *, override: bool = False) -> Callable[[F], F]:
    """Decorator: register ``fn`` as op ``name`` for ``device_type`` (``None`` = portable)."""
    key = device_type or PORTABLE

    def decorate(fn: F) -> F:
        table = _kernels.setdefault(name, {})
        if key in table and not override and table[key] is not fn:
            raise ValueError(f"op {name!r} already has a {key} kernel; pass override=True to replace it")
        table[key] = fn
        return fn

    return decorate


def get_op(name: str, device_type: str) -> Callable[..., Any]:
    """The kernel of ``name`` for ``device_type``, or its portable fallback."""
    table = _kernels.get(name)
    if not table:
        raise KeyError(f"no op named {name!r}; registered ops: {sorted(_kernels)}")
    if device_type in table:
        return table[device_type]
    if PORTABLE not in table:
        raise KeyError(f"op {name!r} has no {device_type} kernel and no portable fallback")
    if device_type != "cpu":
        warn_once(_log, f"op {name!r} has no {device_type} kernel; using the portable implementation")
    return table[PORTABLE]


def call_op(name: str, device_type: str, *args: Any, **kwargs: Any) -> Any:
    return get_op(name, device_type)(*args, **kwargs)


def registered_ops() -> dict[str, tuple[str, ...]]:
    return {name: tuple(sorted(table)) for name, table in _kernels.items()}


def unregister_op(name: str) -> None:
    """Remove every kernel of ``name``; for tests."""
    _kernels.pop(name, None)
