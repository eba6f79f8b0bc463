"""A stand-in ``torch_npu`` for the ``ep.mc2`` NPU backend, on CPU and gloo (no NPU here).

It implements ``npu_moe_distribute_dispatch`` / ``npu_moe_distribute_combine`` with the
signatures and outputs torch_npu documents: dispatch sends every (token, k) row to the
rank of its expert and returns the received rows expert-major, with a padded tail and
per-expert counts; combine sends the rows back and sums them with the routing weights.
So the test checks the backend's glue (arguments, counts, the padded tail, dtypes), not
the NPU's kernels. The state dispatch hands to combine lives here, where the real kernel
keeps it in ``expand_idx``.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

PADDING_ROWS = 3  # the real kernel returns a buffer longer than the rows it received
GROUPS: dict[str, dist.ProcessGroup] = {}


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = rows.new_empty(sum(recv), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def npu_moe_distribute_dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                expert_token_nums_type=1):
    assert expert_token_nums_type == 1  # counts per local expert, as the backend asks
    group, local = GROUPS[group_ep], moe_expert_num // ep_world_size
    flat = expert_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)  # expert-major, so grouped by destination rank
    send = torch.bincount(flat // local, minlength=ep_world_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_list, recv_list = send.tolist(), recv.tolist()
    rows = _exchange(x[order // expert_ids.shape[-1]], send_list, recv_list, group)
    experts = _exchange(flat[order], send_list, recv_list, group) - ep_rank_id * local
    arrival = torch.argsort(experts, stable=True)  # expert-major over every source rank
    expand_x = torch.cat([rows[arrival], rows.new_zeros(PADDING_ROWS, rows.shape[1])])
    counts = torch.bincount(experts, minlength=local)
    npu.last_dispatch = (order, arrival, send_list, recv_list)
    return (expand_x, None, arrival.to(torch.int32), counts, recv, send, None)


def npu_moe_distribute_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                               ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                               expand_scales=None):
    assert expert_scales.dtype == torch.float32  # the kernel takes fp32 routing weights
    order, arrival, send_list, recv_list = npu.last_dispatch
    rows = expand_x[: arrival.numel()]
    received = rows.new_empty(rows.shape).index_copy(0, arrival, rows)
    back = _exchange(received, recv_list, send_list, GROUPS[group_ep])
    tokens, top_k = expert_ids.shape
    slots = back.new_zeros(tokens * top_k, back.shape[-1]).index_copy(0, order, back)
    return (slots.view(tokens, top_k, -1) * expert_scales.unsqueeze(-1).to(back.dtype)).sum(1)


npu = types.ModuleType("torch_npu")
npu.npu_moe_distribute_dispatch = npu_moe_distribute_dispatch
npu.npu_moe_distribute_combine = npu_moe_distribute_combine


def install() -> types.ModuleType:
    """Put the stand-in in ``sys.modules`` as ``torch_npu`` (the backend imports it at import)."""
    sys.modules["torch_npu"] = npu
    return npu


def mc2_npu_vs_fused() -> float:
    """One MoE layer, EP=2, forward only: the NPU backend (on the stand-in) against ``fused``."""
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.distributed.expert_parallel import apply_expert_parallel
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    install()
    backend = importlib.import_module("fsdp_turbo.distributed.expert_parallel.ops.npu_mc2")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    GROUPS["ep"] = mesh.get_group()
    backend._comm_name = lambda group: "ep"  # HCCL's communicator name, on NPU
    model = tiny_hf_causal_lm("qwen3_moe")
    name = "model.layers.0.mlp.experts"
    layer = apply_expert_parallel(model, EPPlanConfig(apply_modules=[name], dispatcher="fused"), mesh)[name]
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = 9 + dist.get_rank()  # uneven, as real batches are
    hidden = torch.randn(tokens, 64, generator=generator)
    index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=generator)
    with torch.no_grad():
        fused = layer(hidden, index, weights)
        npu_out = backend.mc2_npu(layer, layer.ep_experts, hidden, index, weights)
    return float((npu_out - fused).abs().max())
