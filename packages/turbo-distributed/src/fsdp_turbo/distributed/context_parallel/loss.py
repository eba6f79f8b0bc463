"""The full-sequence loss on every CP rank.

Each rank's HF loss is the sum over its chunk's valid tokens divided by the full
sequence's valid-token count (``num_items_in_batch``); summing over CP gives the
full-sequence mean, identical on every rank. Backward scales by cp instead of
communicating: FSDP averages gradients over ``fsdp x cp``, and each rank's parameters
saw only its chunk, so ``cp x`` its share averaged over cp is the whole gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class _SumOverCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.size = size
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.size, None, None


def sum_over_cp(loss: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """For a loss computed outside the model (non-HF): each rank's share -> the full loss."""
    return _SumOverCP.apply(loss, group, size)


class ContextParallelLossFunction:
    """Wraps an HF ``loss_function``: the local share, then the sum over CP."""

    def __init__(self, inner: Callable[..., torch.Tensor], group: dist.ProcessGroup, size: int) -> None:
        self.inner, self.group, self.size = inner, group, size

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return sum_over_cp(self.inner(*args, **kwargs), self.group, self.size)
