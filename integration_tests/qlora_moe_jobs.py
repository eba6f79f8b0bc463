"""Rank functions for QLoRA-MX on a MoE model (importable by spawned ranks): a tiny Qwen3-MoE with
PEFT LoRA on the attention, whose frozen attention bases and fused experts are stored as MX bytes
(``quantization_plan.store_frozen_weights``), against one-process PEFT over the same quantized base.
"""

from __future__ import annotations

import torch
from peft_jobs import ATTENTION, BATCHES, EP_DISPATCHERS, EP_LAYOUT, meta_peft_model, peft_model

from fsdp_turbo.core.testing import shard_rows, train_steps

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
PLAN = {"quant_format": "E4M3", "apply_modules": [*(f"*.{m}" for m in ATTENTION), "*.mlp.experts"],
        "store_frozen_weights": True}
# every dispatcher at EP=2 x efsdp 2, and the experts' own forward under plain FSDP=4
LAYOUTS = {"fsdp4": {"fully_shard_parallel_size": 4},
           **{d: {**EP_LAYOUT, "ep_plan": {"dispatcher": d}} for d in EP_DISPATCHERS}}


def moe_model():
    return peft_model("qwen3_moe", ATTENTION)


def reference_run():
    """One process: PEFT over each frozen attention base and expert weight quantized by the same
    function, then dequantized (the experts run transformers' own forward)."""
    from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
    from fsdp_turbo.quantization.frozen import frozen_weight_values
    from fsdp_turbo.quantization.training.recipe import MXRecipe

    model, recipe = moe_model(), MXRecipe.from_config(QuantizeConfig(**PLAN))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_proj.base_layer.weight", *(f"mlp.experts.{w}" for w in EXPERT_WEIGHTS))):
                param.copy_(frozen_weight_values(param, recipe))
    return train_steps(model, BATCHES)


def _expert_bytes(model) -> tuple[int, int, int, list[str]]:
    """(this rank's stored bytes of the packed expert weights, bytes the all-gathers move for them,
    ranks each all-gather spans, the all-gather inputs' dtypes); the all-gather bytes are what FSDP
    copies into the collective (its all-gather inputs)."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_turbo.quantization.frozen import MXFrozenExperts

    stored = gathered = 0
    ranks, dtypes = set(), set()
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        group = unit._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            info = fsdp_param._module_info
            if not isinstance(info.module, MXFrozenExperts) or info.param_name not in EXPERT_WEIGHTS:
                continue
            local = fsdp_param.sharded_param.to_local()
            stored += local.numel() * local.element_size()
            inputs, span = fsdp_param.all_gather_inputs, group.mesh_info.shard_mesh_size
            gathered += sum(t.numel() * t.element_size() for t in inputs) * span
            ranks.add(span)
            dtypes.update(str(t.dtype) for t in inputs)
    (span,) = ranks
    return stored, gathered, span, sorted(dtypes)


def facade_runs(base: str) -> dict[str, object]:
    """Each layout of ``LAYOUTS`` in the same ranks: the record, the parameters with a gradient that
    should have none, the expert weights' dtypes and their bytes; then how many packed frozen shards
    of a meta-built model loaded from ``base`` differ from those of the model built with its weights."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = {}
    for name, layout in LAYOUTS.items():
        model = FSDPTurbo({**layout, "quantization_plan": PLAN}, moe_model())
        state = model.parallel_state
        dtypes = sorted({str(p.dtype) for n, p in model.named_parameters() if n.endswith(EXPERT_WEIGHTS)})
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
        frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        results[name] = (record, frozen_grads, dtypes, _expert_bytes(model))
    results["meta-built shards that differ"] = _meta_built_difference(base)
    return results


def _meta_built_difference(base: str) -> list[str]:
    """A meta-built model at EP=2 x efsdp 2 filled by ``load_pretrained`` from the base checkpoint,
    against the same model built with its weights: the packed frozen weights (attention bases and
    experts) whose local bytes on this rank are not identical."""
    from fsdp_turbo.checkpoint import load_pretrained
    from fsdp_turbo.core.model_inspect import local_tensor
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    config = {**LAYOUTS["fused"], "quantization_plan": PLAN}
    meta = FSDPTurbo(config, meta_peft_model("qwen3_moe"))
    load_pretrained(meta, base)
    built = dict(FSDPTurbo(config, moe_model()).named_parameters())
    packed = {n: p for n, p in meta.named_parameters() if p.dtype == torch.uint8}
    assert len(packed) == 2 * (len(ATTENTION) + len(EXPERT_WEIGHTS)), sorted(packed)
    return [n for n, p in packed.items() if not torch.equal(local_tensor(p), local_tensor(built[n]))]
