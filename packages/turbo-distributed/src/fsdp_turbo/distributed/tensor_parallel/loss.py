"""Loss parallel: cross-entropy on vocab-sharded logits; the full logits are never gathered.

torch's ``loss_parallel()`` supplies the sharded log-softmax / NLL kernels, but it
must be active for the forward *and* the backward. The user's training loop calls
``loss.backward()`` outside any context we own, so the loss runs inside an autograd
Function whose backward re-enters ``loss_parallel()`` for its own piece of graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from fsdp_turbo.core.model_facts import IGNORE_INDEX


class _ScopedLossParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits: torch.Tensor, layout: tuple, loss_fn: Callable[[DTensor], Any]):
        mesh, placements, shape, stride = layout
        leaf = local_logits.detach().requires_grad_(local_logits.requires_grad)
        with torch.enable_grad(), loss_parallel():
            sharded = DTensor.from_local(leaf, mesh, placements, run_check=False, shape=shape, stride=stride)
            loss = loss_fn(sharded)
            local_loss = loss.to_local() if isinstance(loss, DTensor) else loss
        # The leaf only says where backward's gradient goes: what the loss needs, it saved
        # itself (DTensor wraps a view, not the leaf). Without this, ctx would hold the
        # local logits [B, S, V/tp] until backward, after the caller has dropped them.
        leaf.data = leaf.new_empty(0)
        ctx.leaf, ctx.local_loss = leaf, local_loss
        # A fresh tensor, not a view: FSDP's root warns on (and mishandles) returned views.
        return local_loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        with loss_parallel():
            (grad,) = torch.autograd.grad(ctx.local_loss, ctx.leaf, grad_loss)
        del ctx.leaf, ctx.local_loss
        return grad, None, None


def scoped_loss_parallel(logits: DTensor, loss_fn: Callable[[DTensor], Any]) -> torch.Tensor:
    """Run ``loss_fn`` (any cross-entropy-based loss) on vocab-sharded ``logits`` under
    ``loss_parallel``, forward and backward; returns the (replicated) loss as a tensor."""
    layout = (logits.device_mesh, logits.placements, logits.shape, logits.stride())
    return _ScopedLossParallel.apply(logits.to_local(), layout, loss_fn)


def vocab_parallel_cross_entropy(logits: DTensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX,
                                 reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` on logits sharded on their last (vocab) dim, for non-HF models."""

    def loss_fn(sharded: DTensor) -> Any:
        flat = sharded.float().reshape(-1, sharded.shape[-1])
        return torch.nn.functional.cross_entropy(flat, labels.reshape(-1).to(flat.device),
                                                 ignore_index=ignore_index, reduction=reduction)

    return scoped_loss_parallel(logits, loss_fn)


class LossParallelLossFunction:
    """Wraps an HF ``loss_function`` so it runs on the vocab-sharded logits."""

    def __init__(self, inner: Callable[..., torch.Tensor]) -> None:
        self.inner = inner

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(logits, DTensor):
            return self.inner(logits, labels, *args, **kwargs)
        return scoped_loss_parallel(logits, lambda sharded: self.inner(sharded, labels, *args, **kwargs))
