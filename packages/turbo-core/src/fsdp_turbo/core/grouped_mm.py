"""Grouped GEMMs over expert-major token groups, shared by expert parallel and MX experts.

``torch._grouped_mm`` runs every group in one kernel where the build has it (CUDA sm90+,
and CPU in recent torch); otherwise a loop over the groups gives the same numbers. Its
CPU backward is not usable in torch 2.13, so :func:`grouped_linear` has its own backward
made of two more grouped GEMMs. The autograd function is the op ``grouped_linear`` in the
op registry, so a device kernel can replace it.
"""

from __future__ import annotations

import torch

from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.ops import call_op, register_op

_log = get_logger(__name__)
_runs: dict[tuple[str, torch.dtype], bool] = {}
PROBE = 16  # the probe's sizes: multiples of 16, as the CUDA kernel wants its strides


def _probe(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    # Outside every dispatch mode, with no autograd record: the first call may come from
    # inside a selective-recompute region, whose op log must not see this extra GEMM (the
    # recomputation, which does not probe, would then be handed its output).
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        a = torch.zeros(PROBE, PROBE, dtype=dtype, device=device)
        b = torch.zeros(1, PROBE, PROBE, dtype=dtype, device=device)
        try:
            torch._grouped_mm(a, b, offs=torch.tensor([PROBE], dtype=torch.int32, device=device))
        except (NotImplementedError, RuntimeError) as err:  # the probe only: "no kernel for this"
            return False, f"{type(err).__name__}: {err}".splitlines()[0]
    return True, ""


def grouped_kernel_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on this device type and dtype. Probed once, on a
    tiny input: an unsupported build, device or dtype raises there, and is logged once. The
    real calls then run unguarded, so their errors surface: out of memory, or a layout the
    kernel refuses (on CUDA, strides that are not multiples of 16 bytes)."""
    if not hasattr(torch, "_grouped_mm"):  # this build (asked each call: it is cheap)
        warn_once(_log, "this torch has no torch._grouped_mm; grouped GEMMs run as a loop over the groups")
        return False
    key = (device.type, dtype)
    if key not in _runs:
        reason = ""
        works = dtype in (torch.float32, torch.bfloat16)
        if works:
            works, reason = _probe(device, dtype)
        else:
            reason = f"it takes float32 or bfloat16, not {dtype}"
        if not works:
            warn_once(_log, f"torch._grouped_mm does not run on {device.type} for {dtype} ({reason}); "
                            "grouped GEMMs run as a loop over the groups")
        _runs[key] = works
    return _runs[key]


def _group_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _loop_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    bounds = _group_bounds(offsets)
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for group, (start, end) in enumerate(bounds):
            if end > start:
                torch.mm(a[start:end], b[group], out=out[start:end])
        return out
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in bounds])


# Eager under torch.compile: the group bounds are data (their sizes decide the work), and
# torch 2.13's fake kernel for _grouped_mm rejects float32, which its CPU kernel accepts.
@torch.compiler.disable
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [E, K, N] -> [M, N]`` with row group ``e`` of ``a`` times ``b[e]``; or the
    weight-gradient form ``a [K, M] @ b [M, N] -> [E, K, N]`` with groups along ``M``.
    ``offsets [E]`` are the groups' cumulative end rows (empty groups allowed)."""
    if a.dtype != b.dtype:
        raise ValueError(f"grouped_mm needs one dtype, got {a.dtype} and {b.dtype}")
    if grouped_kernel_runs(a.device, a.dtype):
        return torch._grouped_mm(a, b, offs=offsets.to(torch.int32))
    return _loop_grouped_mm(a, b, offsets)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offsets)
        return grouped_mm(x, weight.transpose(1, 2), offsets)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grouped_mm(grad_out, weight, offsets) if ctx.needs_input_grad[0] else None
        grad_w = grouped_mm(grad_out.t(), x, offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


@register_op("grouped_linear")
def grouped_linear_portable(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _GroupedLinear.apply(x, weight, offsets)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` in groups ending at ``offsets``, ``weight [E, N, K]`` -> ``[M, N]``:
    ``F.linear`` per group, differentiable in ``x`` and ``weight``."""
    if weight.dim() != 3 or offsets.numel() != weight.shape[0]:
        raise ValueError(f"weight must be [E, N, K] with one offset per group; got {tuple(weight.shape)} "
                         f"and {offsets.numel()} offsets")
    return call_op("grouped_linear", x.device.type, x, weight, offsets)
