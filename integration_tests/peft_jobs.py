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


QLORA_TP = "qlora-mx e4m3, sp + loss parallel"


def tp_qlora_plan() -> dict:
    """QLoRA-MX on every projection: each LoRA layer's frozen base stored as packed E4M3 bytes."""
    return {"quant_format": "E4M3", "apply_modules": [f"*.{m}" for m in PROJECTIONS], "store_frozen_weights": True}


def _tp_layouts() -> dict[str, tuple[list[str], dict]]:
    from composed_jobs import FSDP_TP

    plan = FSDP_TP["tp_plan"]
    no_sp = {name: value for name, value in plan.items() if name != "sequence_parallel"}
    return {  # name -> (LoRA targets, config)
        "sp + loss parallel": (PROJECTIONS, FSDP_TP),
        "no sp": (PROJECTIONS, {**FSDP_TP, "tp_plan": no_sp}),
        # the output head a LoRA layer too: its adapter ends vocab-sharded, as the head's logits do
        "lora head, sp + loss parallel": ([*PROJECTIONS, "lm_head"], FSDP_TP),
        # the frozen bases packed MX before TP shards them (colwise: rows; rowwise: whole blocks of columns)
        QLORA_TP: (PROJECTIONS, {**FSDP_TP, "quantization_plan": tp_qlora_plan()}),
    }


TP_LAYOUTS = _tp_layouts()


def over_quantized_bases(model, plan: dict, suffix: str = "_proj.base_layer"):
    """``model`` with the weight of each module whose name ends in ``suffix`` (a PEFT model's LoRA
    bases by default) replaced by the values QLoRA-MX computes with: the whole weight quantized by
    ``frozen_weight_values``, then dequantized."""
    from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
    from fsdp_turbo.quantization.frozen import frozen_weight_values
    from fsdp_turbo.quantization.training.recipe import MXRecipe

    recipe = MXRecipe.from_config(QuantizeConfig(**plan))
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(suffix):
                module.weight.copy_(frozen_weight_values(module.weight, recipe))
    return model


def tp_reference_runs() -> dict[str, object]:
    """Single-process PEFT for each layout of ``TP_LAYOUTS`` (one run per list of targets and base)."""
    by_run = {}
    for targets, config in TP_LAYOUTS.values():
        key = (tuple(targets), "quantization_plan" in config)
        if key not in by_run:
            model = peft_model("llama", targets)
            if "quantization_plan" in config:
                model = over_quantized_bases(model, config["quantization_plan"])
            by_run[key] = train_steps(model, BATCHES)
    return {name: by_run[(tuple(targets), "quantization_plan" in config)]
            for name, (targets, config) in TP_LAYOUTS.items()}


def _tp_placement(param) -> str:
    return str(dict(zip(param.device_mesh.mesh_dim_names, param.placements, strict=True))["tp"])


def _packed_when_tp_comes_first(tp_mesh) -> dict[str, tuple]:
    """Layer 0's q_proj (colwise) and o_proj (rowwise) base weights sharded by TP first, then converted
    (each rank packs its own shard): per weight, whether this rank's packed bytes are its piece of the
    whole weight's packing, the packed placements and global shape, and the forward's greatest
    difference from ``F.linear`` over the whole weight's quantized values; and the error for a
    rowwise shard that holds no whole block."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn import functional

    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
    from fsdp_turbo.quantization.frozen import (
        frozen_weight_values,
        pack_mx,
        quantize_frozen_weight,
        to_mx_frozen_linear,
    )
    from fsdp_turbo.quantization.training.recipe import MXRecipe

    recipe, layer = MXRecipe.from_config(QuantizeConfig(**tp_qlora_plan())), peft_model("llama", PROJECTIONS)
    generator = torch.Generator().manual_seed(5)  # the same input on every rank
    results = {}
    for name, dim in (("q_proj", 0), ("o_proj", 1)):
        weight = layer.get_submodule(f"base_model.model.model.layers.0.self_attn.{name}.base_layer").weight.detach()
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(dim)]), requires_grad=False)
        packed = to_mx_frozen_linear(linear, recipe).weight
        piece = pack_mx(quantize_frozen_weight(weight, recipe)).chunk(tp_mesh.size(), dim)[tp_mesh.get_local_rank()]
        inputs = torch.randn(2, 16, weight.shape[1], generator=generator)
        error = (linear(inputs).full_tensor() - functional.linear(inputs, frozen_weight_values(weight, recipe)))
        results[name] = (torch.equal(packed.to_local(), piece), str(packed.placements), tuple(packed.shape),
                         error.abs().max().item())
    # blocks of 64 leave each rank 32 of o_proj's in_features: refused before anything is packed
    linear = nn.Linear(64, 64, bias=False).requires_grad_(False)
    linear.weight = nn.Parameter(distribute_tensor(linear.weight, tp_mesh, [Shard(1)]), requires_grad=False)
    try:
        to_mx_frozen_linear(linear, MXRecipe.from_config(QuantizeConfig(**tp_qlora_plan(), block_size=64)))
    except ConfigError as refused:
        results["o_proj, block 64"] = str(refused)
    return results


def _qlora_tp_checks(model, out: str, base: str) -> dict:
    """The frozen MX weights of a QLoRA-MX model under FSDP x TP: layer 0's q_proj and o_proj base weight
    (dtype, global and local shape), the stored and all-gathered bytes, the same packing when TP comes
    first, the packed shards of a meta-built model loaded from ``base`` that differ from the built
    model's; then a merged save and the logits it should give."""
    from fsdp_turbo.checkpoint import save_pretrained
    from fsdp_turbo.core.model_inspect import local_tensor

    weights = {n.split("layers.0.")[-1]: (str(p.dtype), tuple(p.shape), tuple(local_tensor(p).shape))
               for n, p in model.named_parameters()
               if "layers.0." in n and n.endswith("base_layer.weight") and ("q_proj" in n or "o_proj" in n)}
    checks = {"weights": weights, "bytes": _frozen_mx_bytes(model),
              "tp first": _packed_when_tp_comes_first(model.parallel_state.mesh("tp")),
              "meta-built shards that differ": _meta_built_difference(base, TP_LAYOUTS[QLORA_TP][1])}
    save_pretrained(model, f"{out}/merged", merge_adapters=True)  # the dequantized base + B @ A
    checks["logits"] = _logits(model)
    return checks


def tp_facade_runs(out: str, base: str) -> dict[str, tuple]:
    """Every layout of ``TP_LAYOUTS`` in the same ranks: the record, the parameters with a gradient
    that should have none, the TP placement of each adapter of layer 0's q_proj and o_proj, and for
    QLoRA-MX the checks of ``_qlora_tp_checks`` (its merged save under ``out``; ``base`` the base
    model's checkpoint)."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = {}
    for name, (targets, config) in TP_LAYOUTS.items():
        model = FSDPTurbo(config, peft_model("llama", targets))
        state = model.parallel_state
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
        frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        placements = {n.split("layers.0.")[-1]: _tp_placement(p) for n, p in model.named_parameters()
                      if "layers.0." in n and ("q_proj" in n or "o_proj" in n)}
        qlora = _qlora_tp_checks(model, out, base) if "quantization_plan" in config else {}
        results[name] = (record, frozen_grads, placements, qlora)
    return results


# ----- fsdp_turbo.checkpoint for PEFT models ---------------------------------------------------------
EVAL_IDS = make_token_batches(vocab_size=256, global_batch=2, seq_len=16, steps=1, seed=7)[0]


def meta_peft_model(kind: str = "llama", *, init_lora_weights: bool | str = False, r: int = 4):
    """``peft_model``'s LoRA built on the meta device, for ``load_pretrained``."""
    from peft import LoraConfig, get_peft_model

    base = tiny_hf_causal_lm(kind, device="meta")
    config = LoraConfig(r=r, lora_alpha=8, target_modules=list(ATTENTION), init_lora_weights=init_lora_weights)
    with torch.device("meta"):
        return get_peft_model(base, config)


def _logits(model) -> torch.Tensor:
    from fsdp_turbo.core.testing import full_tensor

    model.eval()
    with torch.no_grad():
        return full_tensor(model(input_ids=EVAL_IDS.to(next(model.parameters()).device)).logits).cpu()


# layout -> (model, LoRA settings, config): FSDP; TP with sequence and loss parallel, LoRA on every
# projection; CP; (below) EP with LoRA on the experts
SAVE_LAYOUTS = {"fsdp4": ("llama", {"targets": ATTENTION}, LAYOUTS["fsdp4"]),
                "fsdp2 x tp2": ("llama", {"targets": TP_LAYOUTS["sp + loss parallel"][0]},
                                TP_LAYOUTS["sp + loss parallel"][1]),
                "cp2 x fsdp2": ("llama", {"targets": ATTENTION}, LAYOUTS["cp2 x fsdp2"])}


def train_then_save(layout: str, out: str) -> dict:
    """Train LoRA on the layout, then save the adapter and the merged model. Rank 0 returns
    the trained full state and, where a rank's forward sees the whole sequence (no CP), the
    sharded model's logits."""
    import torch.distributed as dist

    from fsdp_turbo.checkpoint import save_pretrained
    from fsdp_turbo.core.testing import full_tensors
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    kind, lora, config = SAVE_LAYOUTS[layout]
    model = FSDPTurbo(config, peft_model(kind, **lora))
    state = model.parallel_state
    train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
    save_pretrained(model, f"{out}/adapter")
    save_pretrained(model, f"{out}/merged", merge_adapters=True)
    full = full_tensors(model.state_dict())
    logits = None if config.get("context_parallel_size", 1) > 1 else _logits(model)
    return {"state": full, "logits": logits} if dist.get_rank() == 0 else {}


def load_base_and_adapter(config: dict, base: str, adapter: str, out: str) -> dict:
    """A meta-built PEFT model, sharded, filled from the base checkpoint plus an adapter
    folder (then saved again); and one filled from the base alone (adapters initialised
    as PEFT does: init_lora_weights=True, so lora_B is zero)."""
    from fsdp_turbo.checkpoint import load_pretrained, save_pretrained
    from fsdp_turbo.core.testing import full_tensors
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, meta_peft_model())
    report = load_pretrained(model, base, adapter=adapter)
    logits = _logits(model)
    save_pretrained(model, out)
    fresh = FSDPTurbo(config, meta_peft_model(init_lora_weights=True))
    load_pretrained(fresh, base)
    adapters = full_tensors({k: v for k, v in fresh.state_dict().items() if ".lora_" in k})
    return {"logits": logits, "read": report.read_bytes, "total": report.checkpoint_bytes,
            "fresh_logits": _logits(fresh), "fresh_adapters": adapters}


def load_bad_adapters(config: dict, base: str, adapters: list[str]) -> list[str]:
    """Each bad adapter folder's error on this rank (its type and message)."""
    from fsdp_turbo.checkpoint import load_pretrained
    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    errors = []
    for adapter in adapters:
        model = FSDPTurbo(config, meta_peft_model())
        try:
            load_pretrained(model, base, adapter=adapter)
            errors.append("loaded")
        except (ConfigError, RuntimeError) as error:  # CheckpointError here; PeerFailure if it was another rank's
            errors.append(f"{type(error).__name__}: {error}")
    return errors


# ----- expert parallel: LoRA on the attention and on the experts (target_parameters) -------------------
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
EP_DISPATCHERS = ["eager", "fused", "mc2", "domino"]
# each dispatcher, and fused with 2 replica slots per EP rank (replicas of the folded LoRA weights)
EP_PLANS = {**{d: {"dispatcher": d} for d in EP_DISPATCHERS},
            "fused, redundant experts": {"dispatcher": "fused", "redundant_experts": 2, "rebalance_every": 1}}
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
    """Every plan of ``EP_PLANS`` in the same ranks: the record, the parameters with a gradient
    that should have none, and the local shape and placements of layer 0's expert parameters
    (the adapters' included)."""
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    results = {}
    for name, ep_plan in EP_PLANS.items():
        model = FSDPTurbo({**EP_LAYOUT, "ep_plan": ep_plan}, moe_peft_model())
        state = model.parallel_state
        layouts = {n.split("layers.0.mlp.")[-1]: _local_layout(p) for n, p in model.named_parameters()
                   if "layers.0.mlp.experts" in n}
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
        frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        results[name] = (record, frozen_grads, layouts)
    return results


SAVE_LAYOUTS["fsdp4, ep2 x efsdp2"] = ("qwen3_moe", {"targets": ATTENTION, "target_parameters": EXPERT_PARAMETERS},
                                       {**EP_LAYOUT, "ep_plan": {}})


# ----- QLoRA-MX: frozen base weights stored and all-gathered in MX (quantization_plan.store_frozen_weights) -----
QLORA_FORMATS = ("E4M3", "HIF8")
QLORA_LAYOUT = {"fully_shard_parallel_size": 4}


def qlora_plan(quant_format: str) -> dict:
    return {"quant_format": quant_format, "apply_modules": [f"*.{m}" for m in ATTENTION],
            "store_frozen_weights": True}


def qlora_reference_runs() -> dict[str, object]:
    """One process: PEFT over each frozen base weight quantized by the same function, then dequantized."""
    from fsdp_turbo.fsdp_turbo_config import QuantizeConfig
    from fsdp_turbo.quantization.frozen import frozen_weight_values
    from fsdp_turbo.quantization.training.recipe import MXRecipe

    runs = {}
    for quant_format in QLORA_FORMATS:
        model, recipe = peft_model(), MXRecipe.from_config(QuantizeConfig(**qlora_plan(quant_format)))
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith("_proj.base_layer"):
                    module.weight.copy_(frozen_weight_values(module.weight, recipe))
        runs[quant_format] = train_steps(model, BATCHES)
    return runs


def _frozen_mx_bytes(model) -> tuple[int, int, int]:
    """(this rank's stored bytes, bytes the all-gathers move, bf16 bytes of the same weights) of the frozen
    MX weights; the all-gather bytes are what FSDP copies into the collective (its all-gather inputs)."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_turbo.quantization.frozen import MXFrozenLinear

    stored = gathered = bf16 = 0
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        group = unit._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            module = fsdp_param._module_info.module
            if not isinstance(module, MXFrozenLinear) or fsdp_param._module_info.param_name != "weight":
                continue
            local = fsdp_param.sharded_param.to_local()
            stored += local.numel() * local.element_size()
            ranks = group.mesh_info.shard_mesh_size
            gathered += sum(t.numel() * t.element_size() for t in fsdp_param.all_gather_inputs) * ranks
            bf16 += module.out_features * module.in_features * 2 // ranks
    return stored, gathered, bf16


def qlora_facade_runs(out: str, base: str) -> dict[str, object]:
    """Each format trained at ``QLORA_LAYOUT``: the record, the frozen weights' dtypes and their bytes.
    Then the last one saved merged (rank 0 returns its logits), and a meta-built QLoRA model loaded from
    ``base`` (the base model's checkpoint): how many frozen shards differ from those quantized from
    the loaded weights at build time."""
    from fsdp_turbo.checkpoint import save_pretrained
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    runs = {}
    for quant_format in QLORA_FORMATS:
        model = FSDPTurbo({**QLORA_LAYOUT, "quantization_plan": qlora_plan(quant_format)}, peft_model())
        state = model.parallel_state
        dtypes = sorted({str(p.dtype) for n, p in model.named_parameters() if n.endswith("_proj.base_layer.weight")})
        record = train_steps(model, [shard_rows(b, state.dp_rank, state.dp_size) for b in BATCHES])
        runs[quant_format] = (record, dtypes, _frozen_mx_bytes(model))
    save_pretrained(model, f"{out}/merged", merge_adapters=True)  # dequantized base + B @ A
    runs["logits"] = _logits(model)
    runs["meta-built shards that differ"] = _meta_built_difference(base)
    return runs


def _meta_built_difference(base: str, config: dict | None = None) -> list[str]:
    """A meta-built QLoRA-MX model filled by ``load_pretrained``, against the same model built with its
    weights: each rank's packed frozen bytes, by name, that are not identical. ``config`` defaults to
    ``QLORA_LAYOUT`` with E4M3."""
    from fsdp_turbo.checkpoint import load_pretrained
    from fsdp_turbo.core.model_inspect import local_tensor
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    config = config or {**QLORA_LAYOUT, "quantization_plan": qlora_plan("E4M3")}
    meta = FSDPTurbo(config, meta_peft_model())
    load_pretrained(meta, base)
    built = dict(FSDPTurbo(config, peft_model()).named_parameters())
    packed = {n: p for n, p in meta.named_parameters() if n.endswith("_proj.base_layer.weight")}
    assert len(packed) == 2 * len(ATTENTION) and all(p.dtype == torch.uint8 for p in packed.values())
    return [n for n, p in packed.items() if not torch.equal(local_tensor(p), local_tensor(built[n]))]
