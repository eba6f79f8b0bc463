"""``ep.mc2`` on Ascend NPUs: torch_npu's fused dispatch (all-to-all-v fused with the
token permute) and combine (all-to-all-v fused with the weighted un-permute).

Those kernels have no autograd, so they serve forward-only calls (evaluation, inference);
a call that needs gradients runs the portable chunked pipeline with a one-time notice.
Limits the kernels document: top-k <= 8, at most 256 (A2) / 512 (A3) tokens per rank,
hidden a multiple of 32 up to 7168.

UNTESTED ON HARDWARE: there is no NPU here. The call follows torch_npu's documented
signatures (``npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch_npu
from torch import nn

from fsdp_turbo.core.logging import get_logger, warn_once
from fsdp_turbo.core.ops import PORTABLE, get_op

_log = get_logger(__name__)
_MAX_TOP_K = 8


def _comm_name(group: dist.ProcessGroup) -> str:
    backend = group._get_backend(torch.device("npu"))
    return backend.get_hccl_comm_name(dist.get_rank())


def mc2_npu(module: nn.Module, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
    needs_grad = torch.is_grad_enabled() and (
        hidden_states.requires_grad or top_k_weights.requires_grad
        or any(p.requires_grad for p in module.parameters()))
    if needs_grad or experts.group is None or top_k_index.shape[-1] > _MAX_TOP_K:
        warn_once(_log, "ep.mc2 on NPU: the fused kernels are forward-only; training runs the portable pipeline")
        return get_op("ep.mc2", PORTABLE)(module, experts, hidden_states, top_k_index, top_k_weights)
    group_ep = _comm_name(experts.group)
    ep_size, ep_rank = experts.ep_size, dist.get_rank(experts.group)
    ids = top_k_index.to(torch.int32)
    expand_x, _, expand_idx, token_counts, ep_recv_counts, tp_recv_counts, expand_scales = (
        torch_npu.npu_moe_distribute_dispatch(hidden_states, ids, group_ep, ep_size, ep_rank,
                                              experts.num_experts, expert_token_nums_type=1))
    # Received rows come expert-major; the tail past the counted rows is padding.
    counts = token_counts.to(torch.int64)
    rows = int(counts.sum())
    out = torch.zeros_like(expand_x)
    out[:rows] = experts.adapter.grouped(module, expand_x[:rows], counts)
    return torch_npu.npu_moe_distribute_combine(
        out, ids, expand_idx, ep_recv_counts, top_k_weights.to(torch.float32), group_ep, ep_size, ep_rank,
        experts.num_experts, tp_send_counts=tp_recv_counts, expand_scales=expand_scales)
