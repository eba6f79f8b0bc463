"""Rank functions for PEFT (LoRA) models through the facade (importable by spawned ranks).

The model is a PEFT ``get_peft_model`` of a tiny HF model; the config is written for the base
model (patterns see through PEFT). ``init_lora_weights=False`` starts ``lora_B`` non-zero, so
every adapter gets a gradient at step 0 (PEFT's default zero ``lora_B`` would leave the
``lora_A`` gradients zero and untested).
"""

from __future__ import annotations

import torch

from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

STEPS = 3
BATCHES = make_token_batches(vocab_size=256, global_batch=8, seq_len=16, steps=STEPS)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LAYOUTS = {
    "fsdp4": {"fully_shard_parallel_size": 4},
    "cp2 x fsdp2": {"fully_shard_parallel_size": 2, "context_parallel_size": 2},
    "memory features": {  # recompute, chunked loss and both swaps, over FSDP=4
        "fully_shard_parallel_size": 4, "recompute": True, "recompute_policy": "selective",
        "chunk_loss": True, "chunk_loss_plan": {"chunk_size": 12},
        "swap_activation": True, "swap_activation_plan": ["model.layers.1"], "swap_optimizer": True,
        "swap_force": True,
    },
}


def peft_model(kind: str = "llama", targets=ATTENTION, **lora):
    from peft import LoraConfig, get_peft_model

    base = tiny_hf_causal_lm(kind)
    torch.manual_seed(1)  # the adapters' init, the same in every process
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False, **lora)
    return get_peft_model(base, config)


def reference_run(kind: str = "llama"):
    return train_steps(peft_model(kind), BATCHES)


def facade_run(kind: str, config: dict):
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, peft_model(kind))
    state = model.parallel_state
    record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    units = sorted(name for name, plan in model.fsdp_turbo_plans.items())
    return record, frozen_grads, units


# ----- tensor parallel: FSDP=2 x TP=2 with the usual Llama TP plan, LoRA on every projection ---------
MLP = ["gate_proj", "up_proj", "down_proj"]
PROJECTIONS = [*ATTENTION, *MLP]


def _tp_layouts() -> dict[str, tuple[list[str], dict]]:
    from composed_jobs import FSDP_TP

    plan = FSDP_TP["tp_plan"]
    no_sp = {name: value for name, value in plan.items() if name != "sequence_parallel"}
    return {  # name -> (LoRA targets, config)
        "sp + loss parallel": (PROJECTIONS, FSDP_TP),
        "no sp": (PROJECTIONS, {**FSDP_TP, "tp_plan": no_sp}),
        # the output head a LoRA layer too: its adapter ends vocab-sharded, as the head's logits do
        "lora head, sp + loss parallel": ([*PROJECTIONS, "lm_head"], FSDP_TP),
    }


TP_LAYOUTS = _tp_layouts()


def tp_reference_runs() -> dict[str, object]:
    """Single-process PEFT for each layout of ``TP_LAYOUTS`` (one run per list of targets)."""
    by_targets = {}
    for targets, _ in TP_LAYOUTS.values():
        if tuple(targets) not in by_targets:
            by_targets[tuple(targets)] = train_steps(peft_model("llama", targets), BATCHES)
    return {name: by_targets[tuple(targets)] for name, (targets, _) in TP_LAYOUTS.items()}


def _tp_placement(param) -> str:
    return str(dict(zip(param.device_mesh.mesh_dim_names, param.placements, strict=True))["tp"])


def tp_facade_runs() -> dict[str, tuple]:
    """Every layout of ``TP_LAYOUTS`` in the same ranks: the record, the parameters with a gradient
    that should have none, and the TP placement of each adapter of layer 0's q_proj and o_proj."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = {}
    for name, (targets, config) in TP_LAYOUTS.items():
        model = FSDPTurbo(config, peft_model("llama", targets))
        state = model.parallel_state
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
        frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        placements = {n.split("layers.0.")[-1]: _tp_placement(p) for n, p in model.named_parameters()
                      if "layers.0." in n and ("q_proj" in n or "o_proj" in n)}
        results[name] = (record, frozen_grads, placements)
    return results


# ----- expert parallel: LoRA on the attention and on the experts (target_parameters) -------------------
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
EP_DISPATCHERS = ["eager", "fused", "mc2", "domino"]
EP_LAYOUT = {"expert_parallel_size": 2, "fully_shard_parallel_size": 4}  # EP=2 x efsdp 2 on 4 ranks


def moe_peft_model():
    """A tiny Qwen3-MoE with LoRA on the attention and, per expert, on its fused weights."""
    return peft_model("qwen3_moe", ATTENTION, target_parameters=EXPERT_PARAMETERS)


def moe_reference_run():
    return train_steps(moe_peft_model(), BATCHES)


def _local_layout(param) -> tuple[tuple[int, ...], str]:
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    return tuple(local.shape), str(param.placements) if isinstance(param, DTensor) else ""


def ep_facade_runs() -> dict[str, tuple]:
    """Every dispatcher of ``EP_DISPATCHERS`` in the same ranks: the record, the parameters with
    a gradient that should have none, and the local shape and placements of layer 0's expert
    parameters (the adapters' included)."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = {}
    for dispatcher in EP_DISPATCHERS:
        model = FSDPTurbo({**EP_LAYOUT, "ep_plan": {"dispatcher": dispatcher}}, moe_peft_model())
        state = model.parallel_state
        layouts = {n.split("layers.0.mlp.")[-1]: _local_layout(p) for n, p in model.named_parameters()
                   if "layers.0.mlp.experts" in n}
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
        frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        results[dispatcher] = (record, frozen_grads, layouts)
    return results
