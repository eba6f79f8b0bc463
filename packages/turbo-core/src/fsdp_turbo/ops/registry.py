"""``fsdp_turbo.ops.registry``: the upstream op-registry path clients import (LLaMA-Factory's
kernel plugins call ``get_op(name)`` with no device).

A thin layer over turbo-core's one registry (``fsdp_turbo.core.ops``), so a kernel
registered here is the kernel the features dispatch to, and the reverse:

* ``register_op(name, device_type=None)``: a decorator, as in ``core.ops`` (``None``: the
  portable implementation every device falls back to);
* ``get_op(name)``: the kernel for the current device (``FSDP_TURBO_DEVICE``, else the
  accelerator ``torch.accelerator`` reports, else the CPU), or the portable one.

``fsdp_turbo.ops`` is a namespace package, so other distributions can add op modules next
to this one (``fsdp_turbo.ops.fla``, for instance).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_turbo.core.device import detect_device_type
from fsdp_turbo.core.ops import call_op as _call_op
from fsdp_turbo.core.ops import get_op as _get_op
from fsdp_turbo.core.ops import register_op, registered_ops

__all__ = ["dispatch_op", "get_op", "register_op", "registered_ops"]


def get_op(name: str, device_type: str | None = None) -> Callable[..., Any]:
    """The kernel of op ``name`` for ``device_type`` (default: the current device)."""
    return _get_op(name, device_type or detect_device_type())


def dispatch_op(name: str, *args: Any, **kwargs: Any) -> Any:
    """Call op ``name`` on the current device's kernel."""
    return _call_op(name, detect_device_type(), *args, **kwargs)
