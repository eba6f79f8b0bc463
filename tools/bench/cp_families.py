"""The 2026 model families under context parallel, for ``context_parallel.py``: one decoder
layer each, float32, CP=4 on 4 gloo ranks, against the same layer in the same run.

- Qwen3-Next's Gated DeltaNet layer (linear attention, then its MoE with a shared expert)
  under Ulysses (the one CP mode a recurrent layer takes): peak activation memory per rank
  (MemTracker, parameters and gradients excluded) during forward + backward, divided by the
  same layer without CP in one process. Both run the same delta-rule kernel (the portable
  ``chunk_gated_delta_rule`` of ``fsdp_turbo.ops.fla``, put where transformers calls its own).

gpt-oss's sliding window (and packed documents, Llama 4's chunks) under every CP mode are
``cp_masks.py``'s.
"""

from __future__ import annotations

import torch
from ulysses import peak_activation_bytes

CP = 4
VOCAB = 1024
QWEN3_NEXT = {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 1, "layer_types": ["linear_attention"],
              "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
              "linear_value_head_dim": 64, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
              "max_position_embeddings": 65536}


def _tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))


def _qwen3_next():
    """The layer, its delta rule on the portable kernel wherever transformers would call its own."""
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    import fsdp_turbo.ops.fla  # noqa: F401 - registers the ops
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.ops.registry import get_op

    modeling.torch_chunk_gated_delta_rule = get_op("chunk_gated_delta_rule", "cpu")
    return tiny_hf_causal_lm("qwen3_next", **QWEN3_NEXT)


def qwen3_next_reference_job(seq: int) -> int:
    ids = _tokens(seq)
    return peak_activation_bytes(_qwen3_next(), input_ids=ids, labels=ids, use_cache=False)


def qwen3_next_cp_job(seq: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.distributed.context_parallel import apply_context_parallel
    from fsdp_turbo.fsdp_turbo_config import CPPlanConfig

    model = _qwen3_next()
    apply_context_parallel(model, CPPlanConfig(mode="ulysses"), init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",)))
    ids = _tokens(seq)
    return peak_activation_bytes(model, input_ids=ids, labels=ids, use_cache=False)


def run(seq: int, report) -> None:
    """Run the jobs, print their lines, and ``report`` each ratio."""
    from fsdp_turbo.core.testing import run_distributed, run_reference

    baseline = run_reference(qwen3_next_reference_job, seq, timeout=1800)
    peak = max(run_distributed(qwen3_next_cp_job, CP, seq, timeout=1800))
    print(f"Qwen3-Next Gated DeltaNet layer (4 value heads, 2 key heads, dims 64, MoE), sequence {seq}: "
          f"no-CP peak {baseline / 2**20:.0f} MiB, Ulysses CP={CP} {peak / 2**20:.0f} MiB per rank")
    report(f"Qwen3-Next (Gated DeltaNet) Ulysses peak activation memory per rank, CP={CP} vs no CP",
           peak / baseline, "<= 0.30", f"{peak / 2**20:.0f} vs {baseline / 2**20:.0f} MiB, sequence {seq}")
