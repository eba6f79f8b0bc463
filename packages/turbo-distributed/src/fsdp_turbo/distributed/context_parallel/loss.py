"""The full-sequence loss on every CP rank.

Each rank's HF loss is the sum over its chunk's valid tokens divided by the full
sequence's valid-token count (``num_items_in_batch``); summing over CP gives the
full-sequence mean, identical on every rank. Backward scales by cp instead of
communicating: FSDP averages gradients over ``fsdp x cp``, and each rank's parameters
saw only its chunk, so ``cp x`` its share averaged over cp is the whole gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_turbo.core.lm_loss import add_loss_reducer
from fsdp_turbo.core.stage_part import stage_role


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


def install_loss_sum(model: torch.nn.Module, group: dist.ProcessGroup, size: int):
    """A forward hook on the root: the output's ``loss`` (an HF ``ModelOutput``), or the output
    itself when the model returns a scalar loss, becomes the full-sequence loss. A hook on the
    output, not a wrapped ``loss_function``, so features that replace the loss function
    (chunked loss, loss parallel) compose with it. A loss computed outside the model by
    ``core.lm_loss`` is summed the same way, after it is computed."""
    add_loss_reducer(model, lambda loss: sum_over_cp(loss, group, size))

    def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            output.loss = sum_over_cp(loss, group, size)
            return output
        role = stage_role(module)
        if isinstance(output, torch.Tensor) and (output.dim() == 0 or (role is not None and role.last)):
            # a scalar loss; or a pipeline's last stage, whose forward ends in the loss (shaped [1])
            return sum_over_cp(output, group, size)
        return output

    return model.register_forward_hook(hook, with_kwargs=True)
