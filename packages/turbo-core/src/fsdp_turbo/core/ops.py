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


class LazyKernel:
    """A device kernel that imports its backend module on the first call.

    Registering one only asks whether the backend's library can be found (no import), so
    importing a package never imports ``triton`` or ``torch_npu`` and never fails without
    them. If the import fails later (the library is present but broken), the op falls back
    to its portable kernel with a one-time warning instead of failing every call.
    """

    def __init__(self, op: str, module: str, attr: str) -> None:
        self.op, self.module, self.attr = op, module, attr
        self._fn: Callable[..., Any] | None = None
        self._fell_back = False

    @property
    def backend(self) -> str:
        """The backend that runs: its module's name, or ``portable`` once it failed to import."""
        self.resolve()
        return PORTABLE if self._fell_back else self.module.rpartition(".")[2]

    def resolve(self) -> Callable[..., Any]:
        if self._fn is None:
            import importlib

            try:
                self._fn = getattr(importlib.import_module(self.module), self.attr)
            except ImportError as err:
                warn_once(_log, f"op {self.op!r}: backend {self.module} does not import ({err}); "
                                "using the portable kernel")
                self._fn = _kernels[self.op][PORTABLE]
                self._fell_back = True
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


def library_available(library: str | None) -> bool:
    """Whether ``library`` can be imported, found on ``sys.path`` without importing it."""
    import importlib.util

    return library is None or importlib.util.find_spec(library) is not None


def register_lazy_kernels(backends: tuple[tuple[str, str, str, str, str | None], ...]) -> dict[tuple[str, str], str]:
    """Register ``(op, device type, module, attribute, library needed or None)`` backends
    whose library is available, as :class:`LazyKernel`; returns ``{(op, device): module}``."""
    registered = {}
    for op, device, module, attr, library in backends:
        if library_available(library):
            register_op(op, device, override=True)(LazyKernel(op, module, attr))
            registered[(op, device)] = module
    return registered


def backend_of(op: str, device_type: str) -> str:
    """Which implementation ``call_op(op, device_type)`` runs: a backend name, or 'portable'
    (also when the device kernel's library failed to import and the portable kernel ran)."""
    kernel = get_op(op, device_type)
    return kernel.backend if isinstance(kernel, LazyKernel) else PORTABLE
