"""``fsdp-turbo plan``: a dry run on the meta device. No processes, no real memory.

It validates the job exactly as ``train`` does, then prints what every pattern matched, the
mesh layout (rank -> coordinates) and a per-rank memory estimate.

The estimate: parameters, gradients and AdamW states are counted per parameter from its
sharding (FSDP over ``fsdp x cp`` with dim-0 padding as FSDP2 pads, TP shards of the planned
Linear/Embedding weights, experts over ``ep x efsdp``, ``dp_replicate`` replicas); AdamW keeps
two fp32 states per parameter and a step count (none on the device with ``swap_optimizer``). Activations per
micro-batch are a formula, not a measurement: per decoder layer ``tokens x (16 H + 3 I)``
values kept for backward without recompute, ``tokens x H`` with full recompute (``x 8 H``
selective), where ``tokens = micro_batch x seq_len / cp`` and ``I`` is the active MLP width,
about two blocks' worth with activation swap; plus the fp32 logits and their gradient (one
chunk of them with the chunked loss). MX quantization keeps fp32 master weights, so it does
not change the model state.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.model import build_model
from fsdp_turbo.core.model_inspect import repeated_blocks
from fsdp_turbo.core.parallel_state import ParallelSizes, ParallelState
from fsdp_turbo.fsdp_turbo import plan_transforms

MIB = 2**20


def compress_names(names: list[str]) -> list[str]:
    """``model.layers.0.mlp``, ``model.layers.1.mlp`` -> ``model.layers.{0-1}.mlp``."""
    groups: dict[str, list[int]] = defaultdict(list)
    singles = []
    for name in names:
        numbers = re.findall(r"(?<=\.)\d+(?=\.|$)", name)
        if len(numbers) != 1:
            singles.append(name)
            continue
        groups[re.sub(r"(?<=\.)\d+(?=\.|$)", "{}", name)].append(int(numbers[0]))
    out = []
    for template, indices in groups.items():
        indices = sorted(indices)
        contiguous = indices == list(range(indices[0], indices[-1] + 1))
        spec = f"{indices[0]}-{indices[-1]}" if contiguous and len(indices) > 1 else ",".join(map(str, indices))
        out.append(template.replace("{}", "{" + spec + "}"))
    return out + singles


@dataclass
class MemoryEstimate:
    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def _fsdp_local(shape: torch.Size, shards: int) -> int:
    if not shape:
        return 1
    rows = math.ceil(shape[0] / shards)  # FSDP2 pads dim 0 to a multiple of the shard count
    return rows * math.prod(shape[1:])


def _inside(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def estimate_memory(model: nn.Module, job: JobConfig, sizes: ParallelSizes, matched: dict[str, list[str]]
                    ) -> MemoryEstimate:
    config = job.turbo
    experts = matched.get("ep_plan.apply_modules", []) if sizes.ep > 1 else []
    tp_sharded = {name: kind for name, kind in matched.get("_tp_kinds", {}).items()
                  if kind in ("colwise", "rowwise", "vocab")} if sizes.tp > 1 else {}
    ignored = matched.get("fsdp_plan.ignored_modules", [])
    fsdp_shards = sizes.fsdp * sizes.cp
    params, tensors = 0, 0
    for name, param in model.named_parameters():
        tensors += 1
        shape = list(param.shape)
        module_name, _, leaf = name.rpartition(".")
        if _inside(name, experts):
            shape[0] //= sizes.ep
            shards = sizes.efsdp
        else:
            kind = tp_sharded.get(module_name)
            if kind is not None and not (kind == "rowwise" and leaf == "bias"):
                dim = 1 if kind == "rowwise" and leaf == "weight" else 0
                shape[dim] //= sizes.tp
            shards = 1 if _inside(name, ignored) else fsdp_shards
        if shards > 1 and shape and shape[0] < shards and _inside(name, experts):
            shape[1] = math.ceil(shape[1] / shards)  # Shard(1) when there are too few experts
            local = math.prod(shape)
        else:
            local = _fsdp_local(torch.Size(shape), shards) if sizes.world > 1 else math.prod(shape)
        params += local * 4  # fp32 master weights
    # AdamW: exp_avg and exp_avg_sq like the parameter, plus a 4-byte step per tensor.
    optimizer = 0 if config.swap_optimizer else 2 * params + 4 * tensors
    return MemoryEstimate(params, params, optimizer, _activations(model, job, sizes))


def _activations(model: nn.Module, job: JobConfig, sizes: ParallelSizes) -> int:
    hf = getattr(model, "config", None)
    hidden = getattr(hf, "hidden_size", 0)
    top_k = getattr(hf, "num_experts_per_tok", None)
    moe_width = getattr(hf, "moe_intermediate_size", None)
    inter = top_k * moe_width if top_k and moe_width else getattr(hf, "intermediate_size", 0)
    layers = len(repeated_blocks(model)) or getattr(hf, "num_hidden_layers", 0)
    tokens = job.run.micro_batch * job.data.seq_len // sizes.cp
    config = job.turbo
    if config.recompute:
        per_layer = tokens * hidden * (8 if config.recompute_policy == "selective" else 1)
        kept = layers * per_layer + tokens * (16 * hidden + 3 * inter)  # one layer re-run at a time
    else:
        kept = layers * tokens * (16 * hidden + 3 * inter)
    if config.swap_activation:
        # Swapped blocks keep their saved tensors on the host; about two blocks' worth (the one
        # running and the one prefetched back) stays on the device.
        kept = min(kept, 2 * kept // max(layers, 1))
    vocab = getattr(hf, "vocab_size", 0)
    logit_rows = min(tokens, config.chunk_loss_plan.chunk_size) if config.chunk_loss else tokens
    return (kept + 2 * logit_rows * vocab // (sizes.tp if config.tp_plan and config.tp_plan.loss_parallel else 1)) * 4


def matched_patterns(model: nn.Module, job: JobConfig, state: ParallelState) -> dict[str, list[str]]:
    """What each plan picked, by field; imports a feature package only when it is used."""
    config, sizes = job.turbo, state.sizes
    out: dict[str, list[str]] = {}
    if sizes.world > 1:
        from fsdp_turbo.distributed.fully_shard_parallel import select_units

        selection = select_units(model, config.fsdp_plan)
        out["fsdp_plan.apply_modules"] = list(selection.units)
        out["fsdp_plan.ignored_modules"] = list(selection.ignored)
    if sizes.tp > 1:
        from fsdp_turbo.distributed.tensor_parallel.transform import resolve_config_tp_plan

        resolved = resolve_config_tp_plan(model, config, sizes.tp, sizes.ep)
        by_kind: dict[str, list[str]] = defaultdict(list)
        for name, kind in resolved.kinds.items():
            by_kind[kind].append(name)
        for kind, names in sorted(by_kind.items()):
            out[f"tp_plan ({kind})"] = names
        out["_tp_kinds"] = dict(resolved.kinds)
    if sizes.ep > 1:
        from fsdp_turbo.distributed.expert_parallel import resolve_ep_plan

        out["ep_plan.apply_modules"] = list(resolve_ep_plan(model, config.ep_plan, sizes.ep))
    if sizes.cp > 1:
        from fsdp_turbo.distributed.context_parallel import resolve_cp_target

        target = resolve_cp_target(model, config.cp_plan)
        out["cp_plan (attention)"] = [target.function_path or f"HF attention '{target.hf_implementation}'"]
    for flag, field in (("recompute", "recompute_plan"), ("swap_activation", "swap_activation_plan"),
                        ("compile", "compile_plan")):
        if getattr(config, flag):
            from fsdp_turbo.core.model_inspect import select_blocks

            out[field] = list(select_blocks(model, getattr(config, field), field=field))
    if config.chunk_loss:
        from fsdp_turbo.memory.chunk_loss.hf_head import resolve_head

        out["chunk_loss_plan.head_module"] = [resolve_head(model, config.chunk_loss_plan.head_module)[0]]
    if config.quantization_plan is not None:
        from fsdp_turbo.quantization.converter.plan import plan_conversion
        from fsdp_turbo.quantization.transform import tensor_parallel_unsuitable

        conversions = plan_conversion(model, config.quantization_plan,
                                      unsuitable=tensor_parallel_unsuitable(model, config))
        out["quantization_plan"] = [f"{c.name} ({c.converter.name})" for c in conversions]
    return out


def default_world_size(job: JobConfig) -> int:
    config = job.turbo
    fsdp = max(config.fully_shard_parallel_size, 1)
    return config.data_parallel_size * fsdp * config.context_parallel_size * config.tensor_parallel_size


def make_plan(job: JobConfig, world_size: int | None = None) -> tuple[list[str], MemoryEstimate]:
    """The plan's lines and memory estimate. Raises ``ConfigError`` as ``train`` would."""
    world = world_size or default_world_size(job)
    sizes = job.turbo.validate(world)
    model = build_model(job.model, job.run.seed, device="meta")
    state = ParallelState(sizes, rank=0, device_type="cpu", distributed=False)
    transforms = plan_transforms(job.turbo, model, state)
    matched = matched_patterns(model, job, state)
    memory = estimate_memory(model, job, sizes, matched)
    lines = [f"FSDPTurbo plan: {type(model).__name__}, "
             f"{sum(p.numel() for p in model.parameters()):,} parameters, world size {world}",
             f"mesh: {state.describe()}",
             f"transforms, in order: {', '.join(t.name for t in transforms) or 'none'}",
             "ranks:  rank  dp_replicate  fsdp  cp  tp  |  edp  efsdp  ep"]
    for rank in range(world):
        coords = ParallelState(sizes, rank=rank, device_type="cpu", distributed=False).coordinates
        lines.append(f"        {rank:4d}  {coords['dp_replicate']:12d}  {coords['fsdp']:4d}  {coords['cp']:2d}  "
                     f"{coords['tp']:2d}  |  {coords['edp']:3d}  {coords['efsdp']:5d}  {coords['ep']:2d}")
    lines.append("patterns:")
    for field, names in matched.items():
        if not field.startswith("_"):
            lines.append(f"  {field}: {', '.join(compress_names(names)) if names else '(none)'}")
    on_host = " (on the host: swap_optimizer)" if job.turbo.swap_optimizer else ""
    lines += [
        "memory per rank (estimate):",
        f"  parameters        {memory.parameters / MIB:10.2f} MiB",
        f"  gradients         {memory.gradients / MIB:10.2f} MiB",
        f"  optimizer states  {memory.optimizer / MIB:10.2f} MiB{on_host}",
        f"  model state       {memory.model_state / MIB:10.2f} MiB",
        f"  activations       {memory.activations / MIB:10.2f} MiB per micro-batch "
        f"({job.run.micro_batch} x {job.data.seq_len} tokens)",
    ]
    return lines, memory


def print_plan(job: JobConfig, world_size: int | None = None) -> None:
    lines, _ = make_plan(job, world_size)
    print("\n".join(lines))
