"""AdamW with linear warmup and cosine decay, and gradient clipping across meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from fsdp_turbo.cli.job_config import OptimizerSection


def build_optimizer(params: Iterable[torch.nn.Parameter], section: OptimizerSection) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=section.lr, betas=section.betas, eps=section.eps,
                             weight_decay=section.weight_decay)


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """The LR multiplier at step ``s``: linear to 1 over ``warmup`` steps, then cosine to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, section: OptimizerSection, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(section.warmup_steps, total_steps, section.min_lr_ratio))


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float | None,
                   pipeline_group: dist.ProcessGroup | None = None) -> float:
    """The global L2 norm of all gradients (clipped to ``max_norm`` when given).

    Dense and expert parameters live on different device meshes (FSDP/TP vs EP), which one
    ``clip_grad_norm_`` call cannot mix: each mesh's norm is taken alone, then combined.
    Under pipeline parallel ``params`` are this rank's stages': the squares are summed over
    ``pipeline_group`` (the ranks holding the other stages) first."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.float() ** 2)
    # a stage without gradients still joins the pipeline's sum, on the training's device
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=params[0].device if params else None)
    if pipeline_group is not None:
        dist.all_reduce(total, group=pipeline_group)
    total_norm = float(total.sqrt())
    if max_norm is not None and total_norm > max_norm:
        scale = max_norm / (total_norm + 1e-6)  # as clip_grad_norm_ does
        for grad in grads:
            grad.mul_(scale)
    return total_norm
