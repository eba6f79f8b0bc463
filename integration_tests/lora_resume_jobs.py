"""Rank functions: LoRA on MoE experts under expert parallel, saved and resumed with the
command's own checkpoint functions (``fsdp_turbo.cli.checkpoint``; importable by spawned ranks)."""

from __future__ import annotations

import torch

from fsdp_turbo.core.testing import full_tensors, shard_rows
from fsdp_turbo.core.testing.parity import causal_lm_loss


def _step(model, optimizer, batch) -> None:
    state = model.parallel_state
    causal_lm_loss(model, shard_rows(batch, state.dp_rank, state.dp_size)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _setup(config: dict):
    from peft_jobs import moe_peft_model

    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, moe_peft_model())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    return model, optimizer


def _meta_moe_peft_model():
    """``moe_peft_model``'s LoRA (attention and experts) on a Qwen3-MoE built on the meta device."""
    from peft import LoraConfig, get_peft_model
    from peft_jobs import ATTENTION, EXPERT_PARAMETERS

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    base = tiny_hf_causal_lm("qwen3_moe", device="meta")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTENTION), target_parameters=EXPERT_PARAMETERS,
                        init_lora_weights=False)
    with torch.device("meta"):
        return get_peft_model(base, config)


def ep_lora_resume(out: str, base: str) -> dict[str, object]:
    """Two steps, a checkpoint, a third step: the trained adapters. Then a fresh model whose adapters
    are moved away, loaded from the checkpoint and stepped once more: its adapters, which must be the
    same bits; the placements of a ``lora_B`` of the experts (strided over the EP ranks); and the
    adapters of a meta-built model filled by ``load_pretrained`` from ``base`` and the trained model's
    saved adapter folder."""
    from peft_jobs import BATCHES, EP_LAYOUT

    from fsdp_turbo.checkpoint import TrainingCheckpointer, load_pretrained, save_pretrained
    from fsdp_turbo.cli.checkpoint import load_checkpoint, save_checkpoint
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    config = {**EP_LAYOUT, "ep_plan": {"dispatcher": "eager"}}
    model, optimizer = _setup(config)
    device = next(model.parameters()).device
    for batch in BATCHES[:2]:
        _step(model, optimizer, batch)
    saved = save_checkpoint(TrainingCheckpointer(device=device), out, "run-test", 2, model, optimizer, {}, keep=1)
    _step(model, optimizer, BATCHES[2])
    trained = full_tensors({n: p for n, p in model.named_parameters() if p.requires_grad})
    resumed, resumed_optimizer = _setup(config)
    with torch.no_grad():
        for p in resumed.parameters():
            if p.requires_grad:
                p.add_(1.0)  # nothing of this survives a correct load
    load_checkpoint(saved, resumed, resumed_optimizer, device)
    _step(resumed, resumed_optimizer, BATCHES[2])
    again = full_tensors({n: p for n, p in resumed.named_parameters() if p.requires_grad})
    placements = sorted({str(p.placements) for n, p in model.named_parameters() if "experts.lora_B" in n})
    save_pretrained(model, f"{out}/adapter")
    loaded = FSDPTurbo(config, _meta_moe_peft_model())
    load_pretrained(loaded, base, adapter=f"{out}/adapter")
    adapters = full_tensors({n: p for n, p in loaded.named_parameters() if p.requires_grad})
    return {"trained": trained, "resumed": again, "lora_B placements": placements, "loaded": adapters}
