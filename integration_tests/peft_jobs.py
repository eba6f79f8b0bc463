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
