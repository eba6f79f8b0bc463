"""torchtitan's Qwen3-MoE for the peer tests (torchtitan 0.2.2), and its training loop.

The model is ``qwen3_args["debugmodel_moe"]`` made small: 2 layers, dim 64, 8 experts, top-2
(softmax scores, ``route_norm``, scores applied after the experts, no shared experts). Its
MoE block routes, counts (``torch.histc``), sorts the rows by expert and calls
``GroupedExperts.forward(x, num_tokens_per_expert)``; that call is all expert parallel
replaces.

Test-side settings, gaps of the CPU build rather than of FSDPTurbo:
- ``moe_args.use_grouped_mm = False``: the grouped path calls a Triton permute kernel;
- ``torch.histc`` on int64 has no CPU kernel: :func:`cpu_histc` counts in float32 and casts
  back (exact: counts are small integers);
- ``init_weights()`` under ``torch.no_grad()``; ``attn_type="sdpa"``.

Load balancing as torchtitan's trainer does it: the MoE blocks add each step's expert counts
to their ``tokens_per_expert`` buffer in forward, and an optimizer step pre-hook (a copy of
torchtitan's ``_update_expert_bias`` in ``components/optimizer.py``) sums them over the data
ranks, moves ``expert_bias`` by ``load_balance_coeff * sign(mean - count)`` and zeroes the
counts. So from step 2 on the routing depends on the bias, and the global counts of every
step are recorded: integers, which must equal the one-process run's exactly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from titan_jobs import batches, logits_loss
from torch import nn

from fsdp_turbo.core.testing import TrainRecord, shard_rows, train_steps

NUM_EXPERTS, TOP_K = 8, 2
TITAN_BLOCKS = ["layers.*"]
TITAN_EXPERTS = ["layers.*.moe.experts"]


@contextlib.contextmanager
def cpu_histc() -> Iterator[None]:
    """``torch.histc`` for integer inputs, which the CPU build lacks: count in float32."""
    original = torch.histc

    def histc(input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if input.is_floating_point():
            return original(input, *args, **kwargs)
        return original(input.float(), *args, **kwargs).to(input.dtype)

    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = original


def titan_qwen3_moe(seed: int = 0) -> nn.Module:
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    args = copy.deepcopy(qwen3_args["debugmodel_moe"])
    args = dataclasses.replace(args, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                               moe_inter_dim=64, vocab_size=256, max_seq_len=64, attn_type="sdpa")
    args.moe_args = dataclasses.replace(args.moe_args, num_experts=NUM_EXPERTS, top_k=TOP_K, use_grouped_mm=False)
    torch.manual_seed(seed)
    model = Qwen3Model(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [block.moe for block in model.get_submodule("layers").values() if block.moe_enabled]


def _update_expert_bias(model: nn.Module, counts_per_step: list[torch.Tensor]) -> None:
    """torchtitan's load-balancing step pre-hook, summing the counts over every rank (each
    rank holds its own data shard in these layouts: no TP or CP)."""
    moes = _moe_blocks(model)
    counts = torch.vstack([moe.tokens_per_expert for moe in moes])
    if dist.is_initialized():
        dist.all_reduce(counts)
    counts_per_step.append(counts.clone())
    with torch.no_grad():
        for moe, tokens in zip(moes, counts, strict=True):
            delta = moe.load_balance_coeff * torch.sign(tokens.mean() - tokens)
            moe.expert_bias.add_(delta - delta.mean())
            moe.tokens_per_expert.zero_()


def _train(model: nn.Module, data: list[torch.Tensor]) -> tuple[TrainRecord, torch.Tensor]:
    """4 AdamW steps with torchtitan's load balancing; the record and every step's counts."""
    counts_per_step: list[torch.Tensor] = []

    def build(params):
        optimizer = torch.optim.AdamW(params, lr=1e-2, foreach=False)
        optimizer.register_step_pre_hook(lambda *_: _update_expert_bias(model, counts_per_step))
        return optimizer

    with cpu_histc():
        record = train_steps(model, data, loss_fn=logits_loss, optimizer_factory=build)
    return record, torch.stack(counts_per_step)


def reference_run() -> tuple[TrainRecord, torch.Tensor]:
    return _train(titan_qwen3_moe(), batches())


def _local_experts(model: nn.Module) -> int:
    """How many experts of the first MoE layer this rank holds (rows of its ``w1`` shard)."""
    from fsdp_turbo.core.model_inspect import local_tensor

    return local_tensor(_moe_blocks(model)[0].experts.w1, differentiable=False).shape[0]


def turbo_run(configs: dict[str, dict]) -> dict[str, tuple[TrainRecord, torch.Tensor, int]]:
    """Each layout in turn, in one launch, through ``FSDPTurbo(config, model)``: the record,
    every step's global expert counts, and the experts this rank holds per layer."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = {}
    for name, config in configs.items():
        model = FSDPTurbo(config, titan_qwen3_moe())
        state = model.parallel_state
        record, counts = _train(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in batches()])
        results[name] = (record, counts, _local_experts(model))
    return results
