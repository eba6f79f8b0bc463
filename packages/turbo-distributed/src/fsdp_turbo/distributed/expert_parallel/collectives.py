"""Differentiable all-to-all with uneven splits.

Built on torch's functional collectives: the call issues the collective and returns at
once; the result waits on first use. That is what lets ``mc2`` overlap a chunk's
all-to-all with the previous chunk's expert compute. Backward is the reverse all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol


def all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int],
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send ``send_splits[r]`` rows of ``x`` to rank ``r``; receive ``recv_splits[r]`` from it.

    Without a group (one EP rank) it is the identity."""
    if group is None:
        return x
    return funcol.all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)


def wait(x: torch.Tensor) -> torch.Tensor:
    """Block until an issued collective's result is ready (a no-op for plain tensors)."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x
