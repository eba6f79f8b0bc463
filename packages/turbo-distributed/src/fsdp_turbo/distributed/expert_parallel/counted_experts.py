"""The built-in form of experts called with expert-sorted rows and per-expert counts
(torchtitan's ``GroupedExperts``), recognised by structure, not by class or import:

- ``w1``, ``w3`` ``[E, I, H]`` and ``w2`` ``[E, H, I]``, 3-D parameters;
- ``forward(x, num_tokens_per_expert)``: ``x`` holds the routed rows already sorted by expert
  (the first ``num_tokens_per_expert[0]`` rows go to expert 0, and so on; rows past the
  counted ones are padding and come back as zeros); the MoE block gathers, sorts, scales
  and combines the rows around this call;
- each expert is ``w2 (silu(w1 x) * w3 x)``.

Under expert parallel the call becomes the dispatchers' own: each row is one slot whose
expert is read off the counts (``repeat_interleave``), with weight 1, so the dispatchers
run unchanged and the result is the rows' expert outputs in the rows' order.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812 - the torch idiom
from torch import nn

from fsdp_turbo.core.grouped_mm import grouped_linear
from fsdp_turbo.core.model_inspect import local_tensor
from fsdp_turbo.distributed.expert_parallel.forms import (
    Dispatch,
    ExpertAdapter,
    keep_expert_rows,
    loop_over_experts,
    register_expert_form,
    replicas_in_forward,
)

COUNTS_ARG = "num_tokens_per_expert"
_WEIGHTS = ("w1", "w2", "w3")


def _takes_counts(module: nn.Module) -> bool:
    """Whether ``module.forward`` is ``(rows, num_tokens_per_expert)``."""
    try:
        params = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(params) == 2 and params[1] == COUNTS_ARG


@register_expert_form
@dataclass(frozen=True)
class CountedExperts(ExpertAdapter):
    form: ClassVar[str] = (f"3-D w1/w3 [E, I, H] and w2 [E, H, I] weights with forward(x, {COUNTS_ARG}), "
                           "x sorted by expert (torchtitan's GroupedExperts)")

    @classmethod
    def detect(cls, module: nn.Module) -> CountedExperts | None:
        w1, w2, w3 = (getattr(module, name, None) for name in _WEIGHTS)
        if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in (w1, w2, w3)):
            return None
        experts, inter, hidden = w1.shape
        if w3.shape != w1.shape or tuple(w2.shape) != (experts, hidden, inter) or not _takes_counts(module):
            return None
        return cls(experts)

    def keep_local_experts(self, module: nn.Module, first: int, count: int, ep_mesh) -> None:
        keep_expert_rows(module, _WEIGHTS, first, count, ep_mesh)

    replicable: ClassVar[bool] = True

    def home_weights(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return {name: local_tensor(getattr(module, name)) for name in _WEIGHTS}

    @staticmethod
    def _weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the replica slots' weights after the experts' own (a copy per forward, with replicas only)
        replicas = replicas_in_forward(module)
        own = [local_tensor(getattr(module, name)) for name in _WEIGHTS]
        return tuple(torch.cat([w, replicas[n]]) if replicas else w for w, n in zip(own, _WEIGHTS, strict=True))

    def eager(self, module: nn.Module, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self._weights(module)

        def run(e: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])

        return loop_over_experts(x, expert, w1.shape[0], run)

    def grouped(self, module: nn.Module, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to(x.dtype) for w in self._weights(module))
        offsets = torch.cumsum(group_sizes, 0)
        h = F.silu(grouped_linear(x, w1, offsets)) * grouped_linear(x, w3, offsets)
        return grouped_linear(h, w2, offsets)

    def run_forward(self, dispatch: Dispatch, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        counts = num_tokens_per_expert.to(torch.long)  # torchtitan counts with histc (floats on CPU)
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
        # Padding rows go to id num_experts: not sent, and zero, as torchtitan pads them.
        padding = expert.new_full((x.shape[0] - expert.numel(),), self.num_experts)
        index = torch.cat([expert, padding]).unsqueeze(1)
        return dispatch(x, index, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device))
